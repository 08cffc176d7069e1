"""A survey row replays from any checkout and names the code that made it (issue #45):
(a) the paths in a row's command are the checkout's relative ones, or under ~ (the survey's venvs, their python a
    symlink that must stay the venv's): no absolute path of the machine that ran it; a path elsewhere (a scratch
    --out) is left as given;
(b) an entry's own cases file (its "cases") is read from the checkout and shown relative to it;
(c) survey.py refuses a checkout with uncommitted changes (exit 2, saying so) unless --allow-dirty: a row's commit is a
    commit, not a commit plus edits nobody can see. Checked on a scratch git repository, before any conform runs;
(d) the committed results: every latest row (experiments/survey/survey_table.py's rule) has a clean commit of this
    history and a command without an absolute path, every manifest entry has rows. Its negative control: a newer CSV
    in a copy whose row is -dirty, holds /work/..., or names a commit not in the history fails, each named.
(e) the survey's torchrun adapters (deepspeed_ulysses.py, arctic_sft.py) decline a step of micro-batches with exit 3
    before torchrun starts: torchrun reports a rank's exit 3 as 1, a "failed to run" row instead of N/A.
No library, no binary.

Usage: python tests/cli/cli_survey_provenance.py BUILD/streambp   (the binary is not used)
"""
import contextlib
import csv
import importlib.util
import io
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments" / "survey"))
import survey  # noqa: E402
import survey_table  # noqa: E402
from known_bugs import newest_rows  # noqa: E402


def main():
    failures = []
    home = Path.home()
    cases = {str(ROOT / "build" / "streambp"): "build/streambp",
             str(ROOT / "verify" / "conform" / "survey" / ".." / "hf_ddp_adapter.py"): "verify/conform/hf_ddp_adapter.py",
             str(home / ".cache" / "streambp" / "survey" / "x" / "bin" / "python"): "~/.cache/streambp/survey/x/bin/python",
             "/nonexistent-scratch/out": "/nonexistent-scratch/out", "--cases": "--cases", "survey": "survey"}
    with tempfile.TemporaryDirectory(dir=home) as tmp:  # a venv's python: a symlink to another interpreter, kept
        link = Path(tmp, "bin-python")
        link.symlink_to(sys.executable)
        cases[str(link)] = "~/" + str(link.relative_to(home))
        failures += [f"portable({g!r}) = {survey.portable(g)!r}, wanted {w!r}" for g, w in cases.items()
                     if survey.portable(g) != w]
    # an entry's own cases file: read from the checkout, shown relative to it; without one, the survey's
    own = survey.entry_cases({"cases": "experiments/survey/cases-trl-dpo.json"}, "survey")
    if not Path(own).is_file() or survey.portable(own) != "experiments/survey/cases-trl-dpo.json":
        failures.append(f"an entry's cases file: {own!r}, shown as {survey.portable(own)!r}")
    if survey.entry_cases({}, "survey") != "survey":
        failures.append("an entry without cases does not run the survey's")


    with tempfile.TemporaryDirectory() as tmp:
        git = ["git", "-C", tmp, "-c", "user.name=t", "-c", "user.email=t@t"]
        subprocess.run(["git", "init", "-q", tmp], check=True)
        Path(tmp, "f").write_text("a\n")
        subprocess.run(git + ["add", "f"], check=True)
        subprocess.run(git + ["commit", "-qm", "c"], check=True)
        Path(tmp, "f").write_text("b\n")  # an uncommitted edit
        survey.ROOT = Path(tmp)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                survey.main(["--streambp", "/bin/false", "--out", str(Path(tmp, "out"))])
                code = 0
            except SystemExit as e:
                code = e.code
        if code != 2 or "uncommitted changes" not in err.getvalue():
            failures.append(f"a dirty checkout: exit {code}, stderr {err.getvalue()!r} (wanted 2, 'uncommitted changes')")
        if Path(tmp, "out", "runs").exists():
            failures.append("a dirty checkout: survey.py made its output folder before refusing")
    failures += committed_rows() + torchrun_declines()
    for f in failures:
        print("FAIL:", f)
    print("ok" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


def committed_rows():
    """(d): the committed rows pass the provenance check; a copy with one bad newer row of each kind fails it."""
    entries = {e["name"]: e for e in json.loads((ROOT / "experiments/survey/implementations.json").read_text())}
    results = ROOT / "results" / "survey"
    problems = survey_table.provenance_problems(newest_rows(results), entries)
    failures = [f"committed results: {p}" for p in problems[:5]] + \
        ([f"... {len(problems) - 5} more"] if len(problems) > 5 else [])
    with tempfile.TemporaryDirectory() as tmp:
        for path in results.glob("survey-*.csv"):
            shutil.copy(path, tmp)
        newest = max(results.glob("survey-*.csv"))
        rows = list(csv.DictReader(open(newest, newline="")))
        bad = {"hf": {"commit": rows[0]["commit"] + "-dirty"},
               "hf-ddp": {"command": "/work/wt/x/build/streambp conform --impl hf --out runs"},
               "deepspeed-tiled": {"command": "build/streambp conform --impl '/root/venv/bin/python a.py'"},
               "mst": {"commit": "0123456789ab"}}  # a commit not in this history
        out = [{**rows[0], "implementation": name, "date": "9999", **change} for name, change in bad.items()]
        with open(Path(tmp, "survey-9999-12-31T00-00-00Z.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, rows[0].keys())
            writer.writeheader()
            writer.writerows(out)
        caught = survey_table.provenance_problems(newest_rows(tmp), entries)
        for name, why in (("hf", "not a clean commit"), ("hf-ddp", "absolute path /work/wt/x"),
                          ("deepspeed-tiled", "absolute path /root/venv"), ("mst", "not in this checkout's history")):
            if not any(p.startswith(name + " ") and why in p for p in caught):
                failures.append(f"negative control: a {name} row with {why} passes the check ({caught[:4]})")
    return failures


def torchrun_declines():
    """(e): a micro-batch case is N/A (3, the reason on stderr) from the launcher itself, no process started."""
    failures = []
    with tempfile.TemporaryDirectory() as case:
        Path(case, "model").mkdir()
        Path(case, "model", "config.json").write_text('{"num_attention_heads": 4, "num_key_value_heads": 2}')
        Path(case, "case.json").write_text('{"objective": {"name": "sft"}, "ranks": 1, "micro_batches": [[0], [1]]}')
        for name in ("deepspeed_ulysses", "arctic_sft"):
            spec = importlib.util.spec_from_file_location(name, ROOT / "verify/conform/survey" / f"{name}.py")
            adapter = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(adapter)
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                code = adapter.launch(case)
            if code != 3 or "2 micro-batches" not in err.getvalue():
                failures.append(f"{name}.py on a micro-batch case: exit {code}, stderr {err.getvalue()[-300:]!r}")
    return failures


if __name__ == "__main__":
    sys.exit(main())
