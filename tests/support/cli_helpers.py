"""What the Python CLI tests share: running `streambp run` and checking a clean rejection (exit 2, the message names
what is wrong, no output file written)."""
import subprocess

FAILURES = []


def run(binary, *args):
    return subprocess.run([binary, "run", *map(str, args)], capture_output=True, text=True)


def expect_rejected(binary, work, what, patterns, args):
    outputs = [work / "out-grads.safetensors", work / "out.json"]
    p = run(binary, *args, "--save-grads", outputs[0], "--json", outputs[1])
    text = p.stdout + p.stderr
    problems = [f"exit {p.returncode}, expected 2"] if p.returncode != 2 else []
    # The message's class too: bad input says "error:", a bug "internal error" (exit 70, experiments/exit_status.h).
    problems += ["an internal error's message"] if "internal error" in text else []
    problems += ["no 'error:' line"] if "error: " not in text else []
    problems += [f"no '{s}' in the message" for s in patterns if s not in text]
    problems += [f"wrote {o.name}" for o in outputs if o.exists()]
    if problems:
        FAILURES.append(f"{what}: {'; '.join(problems)}\n{text}")
    else:
        print(f"ok: {what}: {text.strip().splitlines()[-1]}")


def report():
    for f in FAILURES:
        print("FAIL:", f)
    return 1 if FAILURES else 0
