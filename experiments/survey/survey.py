#!/usr/bin/env python3
"""`make survey`: the public long-context implementations through `streambp conform` (issue #33, docs/survey.md).

For every entry of implementations.json (a library at a pinned version, in one setting, wrapped by a thin adapter in
verify/conform/survey/): its own venv (the pinned requirements; torch from pip's cache), then `streambp conform` over
the case matrix (default: `survey`, T = 300 against tiles of 64), and one summary row per implementation x objective
x dtype in results/survey/survey-<stamp>.csv: the verdict, the worst tensor and its error, the loss error, time and
peak RSS against HF's standard BP on the same cases (the `hf` entry, run first), and the command that made the row.
An entry that cannot run here gets its row all the same, saying why: a library that needs a GPU, a source that is not
on PyPI and not given (its environment variable), a venv that does not install.

Usage: survey.py --streambp build/streambp [--only NAME ...] [--cases survey] [--out results/survey] [--allow-dirty]
                 [--no-time-reference]
"""
import argparse
import csv
import datetime
import fcntl
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ADAPTERS = ROOT / "verify" / "conform" / "survey"
CACHE = Path(os.environ.get("STREAMBP_CACHE", Path.home() / ".cache" / "streambp")) / "survey"
TORCH = "torch==2.14.1"  # the harness's: pip takes it from its cache, no download
CASE_SETS = ("ci", "quick", "full", "survey", "rl", "rl-verl")  # conform's built-in sets (an entry's "cases" may name one)

COLUMNS = ["commit", "date", "machine", "threads", "torch_version", "implementation", "library", "version", "setting", "objective", "dtype",
           "status", "verdict", "cases", "passed", "judged", "not_expressible", "worst_tensor", "worst", "rule",
           "loss_rel_error", "seconds_vs_hf", "peak_rss_vs_hf", "cause", "command", "accumulation"]


def log(message):
    print(f"[survey {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def venv_python(entry):
    """The entry's venv (made or reused: a stamp holds what it was made from) and its python, or raise with why. The
    venv sees the harness venv's packages below its own (a .pth file, like --system-site-packages): torch 2.14.1 is
    the harness's (6 GB a copy), and the pinned requirements, installed in the venv, come first."""
    if entry.get("venv") is None:  # the harness's own venv: the shipped adapters
        return os.environ.get("STREAMBP_PYTHON", sys.executable)
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{entry['venv']}.lock", "w") as lock:  # two surveys at once (make test's slice and yours)
        fcntl.flock(lock, fcntl.LOCK_EX)
        return make_venv(entry)


def make_venv(entry):
    venv = CACHE / entry["venv"]
    source = source_dir(entry)
    base = sysconfig.get_paths()["purelib"]
    wanted = json.dumps({"requirements": entry["requirements"], "no_deps": entry.get("no_deps", []),
                         "env": entry.get("install_env", {}), "base": base,
                         "source": str(source) if source and entry["source"].get("install", True) else None},
                        sort_keys=True)
    stamp = venv / ".survey-stamp"
    python = venv / "bin" / "python"
    if stamp.exists() and stamp.read_text() == wanted and python.exists():
        return str(python)
    log(f"{entry['name']}: making {venv} ({', '.join(entry['requirements'])})")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "streambp_harness_venv.pth").write_text(base + "\n")
    env = dict(os.environ, **entry.get("install_env", {}))
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    done = subprocess.run(pip + [TORCH] + entry["requirements"], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError("pip install failed: " + (done.stderr.strip().splitlines() or ["?"])[-1])
    if entry.get("no_deps"):  # a library whose declared dependencies (a cluster stack) its tested path never imports
        done = subprocess.run(pip + ["--no-deps"] + entry["no_deps"], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError("pip install --no-deps failed: " + (done.stderr.strip().splitlines() or ["?"])[-1])
    if source and entry["source"].get("install", True):
        done = subprocess.run(pip + ["--no-deps", "--no-build-isolation", "-e", str(source)], env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"pip install -e {source} failed: " + (done.stderr.strip().splitlines() or ["?"])[-1])
    stamp.write_text(wanted)
    return str(python)


def source_dir(entry):
    """A library that is not on PyPI: a checkout named by an environment variable, at the pinned commit."""
    src = entry.get("source")
    if not src:
        return None
    path = os.environ.get(src["env"])
    if not path:
        raise RuntimeError(f"{src['repo']} is not on PyPI and this machine reaches only PyPI and Debian: set "
                           f"{src['env']} to a checkout of {src['repo']} at {src['commit'][:7]}")
    path = Path(path).resolve()
    commit = (path / "COMMIT").read_text().strip() if (path / "COMMIT").exists() else None
    if commit is None and (path / ".git").exists():
        commit = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if commit and not commit.startswith(src["commit"][:7]):
        raise RuntimeError(f"{src['env']}={path} is at {commit[:7]}, the survey pins {src['commit'][:7]}")
    return path


def gpu_problem(entry):
    if entry.get("not_run"):  # a library listed with why it has no adapter (its path needs what no CPU has)
        return entry["not_run"]
    if not entry.get("gpu"):
        return None
    try:
        import torch
        if torch.cuda.is_available():
            return None
    except ImportError:
        pass
    return "needs a GPU: " + entry["gpu"]


def run_conform(streambp, entry, python, cases, out_dir):
    """`streambp conform` over the entry's adapter; the path of the CSV it wrote and its command line."""
    impl = " ".join([shlex.quote(python), shlex.quote(str(ADAPTERS / entry["adapter"]))] +
                    [shlex.quote(a) for a in entry.get("args", [])]) if entry.get("adapter") else entry["impl"]
    command = [streambp, "conform", "--impl", impl, "--cases", cases, "--out", str(out_dir)]
    for flag in ("objectives", "dtypes", "accumulation", "only"):  # only: the entry's cases of its case set
        if entry.get(flag):
            command += [f"--{flag}", entry[flag] if flag == "accumulation" else ",".join(entry[flag])]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **entry.get("env", {}))
    log(f"{entry['name']}: {' '.join(shlex.quote(c) for c in command)}")
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    found = re.search(r"results: (\S+\.csv)", done.stdout)
    if not found:
        raise RuntimeError("conform wrote no results: " + (done.stderr.strip().splitlines() or ["?"])[-1])
    settings = [f"{k}={shlex.quote(v)}" for k, v in entry.get("env", {}).items()]  # part of the command: DS_LOSS=...
    shown = [portable(streambp), "conform", "--impl", " ".join(portable(a) for a in shlex.split(impl))] + \
        [portable(c) for c in command[4:]]
    return Path(found.group(1)), " ".join(settings + [shlex.quote(c) for c in shown])


def portable(arg):
    """A path in a row's command as another machine replays it from the checkout (conform runs there): relative to
    the checkout, or under ~ (the survey's venvs); anything else unchanged."""
    if not arg.startswith("/"):
        return arg
    path = Path(os.path.normpath(arg))  # not resolve(): a venv's python is a symlink to the interpreter it came from
    for base, prefix in ((ROOT, ""), (Path.home(), "~/")):
        if path.is_relative_to(base):
            return prefix + str(path.relative_to(base))
    return arg


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def group_key(row, ranks_by_case, paths_by_case=None):
    setting = list((paths_by_case or {}).get(row["case"], []))
    if row["lora"]:
        setting.append("LoRA")
    ranks, parallel = ranks_by_case.get(row["case"], (1, "data"))
    if ranks > 1:
        setting.append(f"{ranks} ranks" + (", the sequence split" if parallel == "sequence" else ""))
    return row["objective"].split(":")[0], row["dtype"], ", ".join(setting)


def number(cell):
    """A CSV cell as a number for ordering: empty is None, anything not a finite number +inf (it then fails and is
    the worst: a NaN compares false with every bar, issue #44)."""
    if not cell:
        return None
    try:
        x = float(cell)
    except ValueError:
        return math.inf
    return x if math.isfinite(x) else math.inf


def judged_pass(row):
    """conform's verdict on a case, fail-closed: a passed row needs a finite worst error, and a finite loss error
    when it has one."""
    loss = number(row["loss_rel_error"])
    return row["status"] == "passed" and number(row["worst"]) not in (None, math.inf) and loss != math.inf


def ratio(mine, theirs):
    values = [number(m) / number(t) for m, t in zip(mine, theirs)
              if number(m) not in (None, math.inf) and number(t) not in (None, math.inf) and number(t) > 0]
    return f"{statistics.median(values):.2f}" if values else ""


def path_words(case):
    """The training path of a listed case (conform --list-cases) as a row's setting: packed rows, its micro-batches
    and its head; a whole RL step (kind rl_step) its own settings, each case a row."""
    if case.get("kind") == "rl_step":
        return ["a whole RL step: " + case["description"]]
    words = ["packed rows"] if case.get("pack_lengths") else []
    words += [f"{len(case['micro_batches'])} micro-batches"] if case.get("micro_batches") else []
    return words + ["tied head" if case.get("tied", True) else "untied head"]


def summarize(entry, rows, hf_rows, command, ranks_by_case, provenance, paths_by_case=None):
    """One row per objective x dtype (x LoRA / ranks) of the entry's cases."""
    hf = {r["case"]: r for r in hf_rows}
    groups = {}
    for r in rows:
        groups.setdefault(group_key(r, ranks_by_case, paths_by_case), []).append(r)
    out = []
    for (objective, dtype, setting), members in sorted(groups.items()):
        judged = [r for r in members if r["status"] in ("passed", "failed")]
        failed = [r for r in judged if not judged_pass(r)]
        na = [r for r in members if r["status"] == "not expressible"]
        worst = max((r for r in (failed or judged) if r["worst"]), key=lambda r: number(r["worst"]), default=None)
        # A failure whose gradients are within their bar (fp64: 1e-10; low precision: ratio <= 1) is the loss's.
        grads_ok = all(r["worst"] and number(r["worst"]) <= (1e-10 if r["dtype"] == "fp64" else 1.0) for r in failed)
        if failed:
            verdict = "failed to run" if not any(r["worst"] for r in failed) else \
                      ("wrong loss, gradients exact" if grads_ok else "wrong")
        else:
            verdict = "exact" if judged else "not expressible"
        if verdict == "exact" and dtype != "fp64":
            verdict = "within the low-precision rule"
        if failed:
            first = failed[0]
            cause = first["problem"] if first["status"] == "failed" else \
                f"{first['case']}: passed by conform with worst {first['worst'] or '(none)'} and loss error " \
                f"{first['loss_rel_error'] or '(none)'}, not finite numbers"
        else:
            cause = na[0]["problem"] if na and not judged else ""
        out.append({**provenance, "implementation": entry["name"], "library": entry["library"],
                    "version": entry["version"], "setting": ", ".join(filter(None, [entry["setting"], setting])),
                    "objective": objective, "dtype": dtype, "status": "passed" if not failed and judged else
                    ("failed" if failed else "not expressible"), "verdict": verdict,
                    "cases": " ".join(r["case"] for r in members), "passed": len(judged) - len(failed),
                    "judged": len(judged), "not_expressible": len(na),
                    "worst_tensor": worst["worst_tensor"] if worst else "", "worst": worst["worst"] if worst else "",
                    "rule": worst["rule"] if worst else "",
                    "loss_rel_error": max((r["loss_rel_error"] for r in judged if r["loss_rel_error"]),
                                          key=number, default=""),
                    "seconds_vs_hf": ratio([r["seconds"] for r in judged], [hf.get(r["case"], {}).get("seconds") for r in judged]),
                    "peak_rss_vs_hf": ratio([r["peak_rss_bytes"] for r in judged],
                                            [hf.get(r["case"], {}).get("peak_rss_bytes") for r in judged]),
                    "cause": cause, "command": command,
                    # what a micro-batch row was judged against (conform's column; the entry's "accumulation")
                    "accumulation": next((r["accumulation"] for r in members if r.get("accumulation")), "")})
    return out


def unavailable_row(entry, provenance, why):
    return {**provenance, "implementation": entry["name"], "library": entry["library"], "version": entry["version"],
            "setting": entry["setting"], "objective": ",".join(entry.get("objectives", [])) or "all",
            "dtype": ",".join(entry.get("dtypes", [])) or "all", "status": "not run",
            "verdict": why.split(":")[0], "cause": why,
            # no conform ran: the row's command is the survey's own, which gives the same reason on another machine
            "command": f'make survey SURVEY_ARGS="--only {entry["name"]}"'}


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--streambp", default=str(ROOT / "build" / "streambp"))
    parser.add_argument("--only", nargs="*", help="entries by name (the hf entry always runs: the time reference)")
    parser.add_argument("--cases", default="survey")
    parser.add_argument("--out", default=str(ROOT / "results" / "survey"))
    parser.add_argument("--manifest", default=str(HERE / "implementations.json"))
    parser.add_argument("--no-time-reference", action="store_true",
                        help="leave out the hf entry (the reference of the *_vs_hf columns, which stay empty): for a "
                             "run that compares verdicts only, such as make test's slices")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="run on uncommitted changes (a test's scratch run); the rows' commit says -dirty")
    args = parser.parse_args(argv)
    entries = json.loads(Path(args.manifest).read_text())
    if args.only:
        unknown = set(args.only) - {e["name"] for e in entries}
        if unknown:
            parser.error(f"--only: no entry {sorted(unknown)} in {args.manifest}")
        entries = [e for e in entries if e["name"] in args.only or e["name"] == "hf"]
    if args.no_time_reference:
        entries = [e for e in entries if e["name"] != "hf"]
    # conform runs from the checkout: a relative --out or cases file is the caller's
    out = Path(args.out).resolve()
    if args.cases not in CASE_SETS:
        args.cases = str(Path(args.cases).resolve())
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    changed = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True).stdout.strip()
    if changed:  # a row names the code that made it: a commit, not a commit plus edits nobody can see
        if not args.allow_dirty:
            parser.exit(2, f"survey.py: the checkout has uncommitted changes ({changed.splitlines()[0].strip()} ...): "
                           "commit them first (or --allow-dirty for a scratch run; its rows say -dirty)\n")
        commit += "-dirty"
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H-%M-%SZ")
    provenance = {"commit": commit, "date": stamp, "machine": "", "threads": "", "torch_version": ""}
    ranks_by_case, paths_by_case, listed = {}, {}, set()
    table, hf_rows = [], []
    for entry in sorted(entries, key=lambda e: e["name"] != "hf"):
        try:
            problem = gpu_problem(entry)
            if problem:
                raise RuntimeError(problem)
            python = venv_python(entry)
            cases = entry_cases(entry, args.cases)
            csv_path, command = run_conform(args.streambp, entry, python, cases, runs)
        except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
            log(f"{entry['name']}: {e}")
            table.append(unavailable_row(entry, provenance, str(e)))
            continue
        rows = read_rows(csv_path)
        if rows:
            for key in ("machine", "threads", "torch_version"):
                provenance[key] = rows[0][key]
        if entry["name"] == "hf":
            hf_rows = rows
        if cases not in listed:  # the survey's cases (hf's, when it runs), and an entry's own, which name their paths too
            listed.add(cases)
            listing = case_ranks(args.streambp, cases)
            ranks_by_case.update({c["name"]: (c.get("ranks", 1), c.get("parallel", "data")) for c in listing})
            paths_by_case.update({c["name"]: path_words(c) for c in listing})
        table += summarize(entry, rows, hf_rows, command, ranks_by_case, provenance, paths_by_case)
    for row in table:
        for key in ("machine", "threads", "torch_version"):
            row[key] = row[key] or provenance[key]
    path = out / f"survey-{stamp}.csv"
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(table)
    os.replace(tmp, path)
    print(markdown(table))
    print(f"\nresults: {path}")
    return 0


def entry_cases(entry, cases):
    """The cases an entry runs: its own set (conform's rl: whole RL steps) or file (relative to the checkout) when the
    survey's matrix cannot hold its path, e.g. a DPO step of micro-batches on a model its pinned transformers loads;
    else the survey's."""
    if entry.get("cases") in CASE_SETS:
        return entry["cases"]
    return str(ROOT / entry["cases"]) if entry.get("cases") else cases


def case_ranks(streambp, cases):
    """The matrix's cases with their ranks and how they split the work, from the harness itself (`streambp conform
    --list-cases`)."""
    done = subprocess.run([streambp, "conform", "--cases", cases, "--list-cases"], capture_output=True, text=True)
    return json.loads(done.stdout) if done.returncode == 0 else []


def markdown(table):
    lines = ["| implementation | version | setting | objective | dtype | verdict | passed | worst tensor | error | "
             "time vs HF | RSS vs HF |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            r["implementation"], r["version"], r.get("setting", ""), r.get("objective", ""), r.get("dtype", ""),
            r["verdict"], f"{r.get('passed', '')}/{r.get('judged', '')}" if r.get("judged") != "" and "judged" in r else "",
            r.get("worst_tensor", ""), r.get("worst", ""), r.get("seconds_vs_hf", ""), r.get("peak_rss_vs_hf", "")))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
