"""Warm starts: an adapter process that skips its own `import torch, transformers` (seconds per case on a small CPU).

A server imports the heavy modules once and forks a worker per adapter run; the adapter script's first lines hand
the run to it:

    python -m streambp_conform serve /tmp/warm.sock &               # once, e.g. at the start of a CI job
    export STREAMBP_CONFORM_WARM=/tmp/warm.sock                     # then conform runs adapters as usual

    # at the top of the adapter script, before it imports torch:
    from streambp_conform.warm import delegate
    delegate()

`delegate()` sends its command line, working directory, environment and standard streams to the server and exits
with the worker's status. Only a server of the caller's own python environment (sys.prefix: venv pythons are
symlinks to one binary, so the executable says nothing) takes the run: a worker forked from another venv would run
the script on that venv's torch and packages (pytest --streambp-warm's server is the user's venv; conform's `hf`
baseline runs in the harness's). Another environment's server declines and the script runs cold. The worker joins
the caller's process group, so `streambp conform` measures, times out and kills it as it would the adapter itself; if
it cannot (another session), the server kills it when the caller goes.
The worker is a fork: whatever the adapter patches or sets stays in it. Without the variable, or with no server
answering, `delegate()` returns and the script runs cold, as before. What differs from a cold run: modules the
server preloaded read their import-time settings from the server's environment, not the run's; and a worker's peak
RSS counts the pages it touches, not the preloaded libraries' untouched pages a cold process maps, so compare peaks
only between runs of one kind.

conform counts the CPU time of the process it started; a worker is not its child, so the worker adds its own in
result.json ("cpu_seconds"), which conform adds (protocol.write_outputs).
"""
import json
import os
import select
import signal
import socket
import sys

ENV = "STREAMBP_CONFORM_WARM"
# The protocol's model families (case.json's model_type) and PEFT: importing a model class costs as much as torch
DEFAULT_PRELOAD = ("torch", "safetensors.torch", "transformers", "transformers.models.qwen3.modeling_qwen3",
                   "transformers.models.qwen2.modeling_qwen2", "transformers.models.llama.modeling_llama", "peft")
_MAX_MESSAGE = 1 << 20
_in_worker = False


def in_worker():
    """True in a process a warm server forked to run an adapter."""
    return _in_worker


def _environment():
    """This python's environment: its venv (or installation) folder, symlinks resolved."""
    return os.path.realpath(sys.prefix)


def delegate():
    """Run this script in a warm worker and exit with its status; return (to run cold) when none is available."""
    path = os.environ.get(ENV)
    if not path or _in_worker:
        return
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        return  # no server: run cold
    env = {k: v for k, v in os.environ.items() if k != ENV}
    request = {"argv": [os.path.abspath(sys.argv[0]), *sys.argv[1:]], "cwd": os.getcwd(), "env": env,
               "pgid": os.getpgid(0), "prefix": _environment()}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    reply = conn.recv(_MAX_MESSAGE)
    answer = json.loads(reply) if reply else {"status": 1}
    if "declined" in answer:  # another python environment's server: run cold
        conn.close()
        return
    status = answer["status"]
    if not reply:
        print("streambp_conform.warm: the warm server went away during the run", file=sys.stderr)
    if status < 0:  # killed by a signal: die of the same one, as the cold process would have
        if -status not in (signal.SIGKILL, signal.SIGSTOP):  # the two that have no handler to reset
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status)


def _worker(request, fds):
    global _in_worker
    _in_worker = True
    try:
        os.setpgid(0, request["pgid"])  # conform's group: its RSS sampling, --timeout and kill reach the worker
    except OSError:
        pass  # another session: the server kills this worker when the caller goes
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = request["argv"]
    sys.path[0] = os.path.dirname(sys.argv[0])
    import runpy
    import traceback

    code = 0
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001  the cold script would have printed it and exited 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _decline(caller, fds, request):
    """A caller of another python environment: it runs cold, in its own."""
    for fd in fds:
        os.close(fd)
    print(f"streambp_conform serve: declined {' '.join(request['argv'])}: its python environment "
          f"{request.get('prefix')} is not this server's {_environment()} (it runs cold)", file=sys.stderr, flush=True)
    try:
        caller.send(json.dumps({"declined": _environment()}).encode())
    except OSError:
        pass
    caller.close()


def serve(path, preload=DEFAULT_PRELOAD):
    """Import `preload`, then fork a worker for every request on the socket at `path` until SIGTERM or SIGINT. The
    socket appears once the imports are done: a caller that finds none runs cold."""
    import importlib

    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError as e:  # not in this environment: the workers import what they need themselves
            print(f"streambp_conform serve: not preloaded: {name} ({e})", file=sys.stderr)
    if os.path.exists(path):
        os.remove(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(16)
    workers = {}  # pid -> the caller's connection
    groups = {}  # pid -> the caller's process group
    commands = {}  # pid -> its command line, for the log line when it ends

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        while True:
            ready, _, _ = select.select([server, *workers.values()], [], [], 0.05)
            for conn in ready:
                if conn is server:
                    caller, _ = server.accept()
                    message, fds, _, _ = socket.recv_fds(caller, _MAX_MESSAGE, 3)
                    if len(fds) != 3 or not message:
                        caller.close()
                        continue
                    request = json.loads(message)
                    # a caller that does not say (an older package: it cannot run cold on a refusal) is served
                    if request.get("prefix", _environment()) != _environment():
                        _decline(caller, fds, request)
                        continue
                    pid = os.fork()
                    if pid == 0:
                        server.close()
                        for other in [caller, *workers.values()]:
                            other.close()
                        _worker(request, fds)
                    for fd in fds:
                        os.close(fd)
                    workers[pid], groups[pid], commands[pid] = caller, request["pgid"], " ".join(request["argv"])
                else:  # a caller hung up before its worker finished (killed)
                    pid = next(p for p, c in workers.items() if c is conn)
                    try:  # in the caller's group the signal that killed the caller reached the worker too, and
                        # conform gives the group its grace; out of it, nothing else will stop the worker
                        if os.getpgid(pid) != groups[pid]:
                            os.kill(pid, signal.SIGKILL)
                        else:
                            del workers[pid]  # reaped below without a caller to tell
                            conn.close()
                    except ProcessLookupError:
                        pass
            while groups:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                groups.pop(pid, None)
                code = os.waitstatus_to_exitcode(status)  # negative: the signal that killed it
                print(f"streambp_conform serve: worker {pid} ({commands.pop(pid, '?')}) "
                      f"{f'killed by signal {-code}' if code < 0 else f'exited {code}'}", file=sys.stderr, flush=True)
                caller = workers.pop(pid, None)
                if caller is None:
                    continue
                try:
                    caller.send(json.dumps({"status": code}).encode())
                except OSError:
                    pass
                caller.close()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        if os.path.exists(path):
            os.remove(path)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] != "serve":
        print("Usage: python -m streambp_conform serve SOCKET [MODULE ...]   (default modules: "
              f"{' '.join(DEFAULT_PRELOAD)}); adapters call streambp_conform.warm.delegate() with {ENV}=SOCKET",
              file=sys.stderr)
        return 2
    serve(argv[1], tuple(argv[2:]) or DEFAULT_PRELOAD)
    return 0
