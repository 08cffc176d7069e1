#!/usr/bin/env python3
"""The known-bug recall table (issue #45): every publicly reported gradient or normalisation bug of
known_bugs.json, judged by `streambp conform` at its buggy pin and at its fixed pin, from the survey's own rows.

A bug with two survey entries ("buggy", "fixed": names in implementations.json) takes, for each, the rows of the
newest results/survey/survey-*.csv that has that entry (so `make survey SURVEY_ARGS="--only A B"` refreshes one bug).
It is "recalled" when the buggy pin fails (conform names the worst tensor) and the fixed pin passes. A bug the harness
cannot run, or runs without seeing, says why ("not_caught"; "buggy_pin" and "buggy_verdict" for a pin that ran and
passed). A bug recalled so far only by a reproduction of its own (experiments/survey/repro/) gives that script's
measured verdicts ("repro": its command; "needs": the survey rows it lacks). Writes results/survey/known-bugs.csv
and known-bugs.md (temp file, then rename); exits 1 when an entry that should recall a bug does not (missed, or the
fixed pin fails too).

Usage: known_bugs.py [--survey results/survey] [--bugs experiments/survey/known_bugs.json] [--manifest ...]
"""
import argparse
import csv
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

COLUMNS = ["library", "reference", "bug", "buggy_pin", "buggy_verdict", "worst_tensor", "buggy_error", "fixed_pin",
           "fixed_verdict", "fixed_worst_tensor", "fixed_error", "recall", "reason", "buggy_entry", "fixed_entry",
           "commit", "machine", "command"]


def newest_rows(survey_dir):
    """implementation -> its rows in the newest survey CSV that has it (file names sort by their UTC stamp)."""
    rows = {}
    for path in sorted(Path(survey_dir).glob("survey-*.csv")):
        with open(path, newline="") as f:
            by_impl = {}
            for r in csv.DictReader(f):
                by_impl.setdefault(r["implementation"], []).append(r)
        rows.update(by_impl)
    return rows


def error_text(row):
    if not row or not row["worst"]:
        return ""
    if row["dtype"] == "fp64":
        return f"{float(row['worst']):.2g} normwise ({row['dtype']})"
    return f"{float(row['worst']):.2g}x the bar ({row['dtype']})"


def judge(rows):
    """(verdict, the row to show, failed?) for one entry's rows: its worst failing group, fp64 first (there the error
    is the tensor's own normwise error), or its first passing one; None when it did not run."""
    if not rows:
        return "not run", None, None
    judged = [r for r in rows if r["status"] in ("passed", "failed")]
    if not judged:
        return rows[0]["cause"] or rows[0]["verdict"], None, None
    failed = [r for r in judged if r["status"] == "failed"]
    dtypes = ", ".join(dict.fromkeys(r["dtype"] for r in (failed or judged)))
    if failed:
        worst = max(failed, key=lambda r: (r["dtype"] == "fp64", float(r["worst"] or "inf")))
        return f"fails in {len(failed)} of {len(judged)} groups ({dtypes}): {worst['verdict']}", worst, True
    return f"passes in {len(judged)} of {len(judged)} groups ({dtypes})", judged[0], False


def table_row(bug, rows, entries):
    buggy_entry, fixed_entry = bug.get("buggy", ""), bug.get("fixed", "")
    row = {"library": bug["library"], "reference": bug["reference"], "bug": bug["bug"],
           "buggy_entry": buggy_entry, "fixed_entry": fixed_entry, "reason": bug.get("not_caught", "")}
    if not buggy_entry and bug.get("repro"):
        # recalled by a reproduction with the library alone (experiments/survey/repro/), before the survey has rows
        # for its pins: its measured verdicts, its command, and the rows it still needs ("needs")
        row.update({k: bug.get(k, "") for k in ("buggy_pin", "buggy_verdict", "worst_tensor", "buggy_error",
                                                "fixed_pin", "fixed_verdict", "fixed_error")},
                   recall="reproduced, no survey row yet", reason=bug.get("needs", ""), command=bug["repro"])
        return row
    if not buggy_entry:
        # a pin that runs but cannot show the bug (it passes) states its verdict ("buggy_verdict") and its reason
        row.update(buggy_pin=bug.get("buggy_pin", ""), fixed_pin=bug.get("fixed_pin", ""), recall="not caught",
                   buggy_verdict=bug.get("buggy_verdict", "not run"), fixed_verdict="not run")
        return row
    b_rows, f_rows = rows.get(buggy_entry, []), rows.get(fixed_entry, [])
    b_verdict, b_show, b_failed = judge(b_rows)
    row.update(buggy_pin=pin(entries, buggy_entry), buggy_verdict=b_verdict,
               worst_tensor=b_show["worst_tensor"] if b_show else "", buggy_error=error_text(b_show),
               command=f'make survey SURVEY_ARGS="--only {" ".join(filter(None, [buggy_entry, fixed_entry]))}"',
               commit=" / ".join(dict.fromkeys(r[0]["commit"] for r in (b_rows, f_rows) if r)),
               machine=(b_rows or f_rows or [{}])[0].get("machine", ""))
    if fixed_entry:
        f_verdict, f_show, f_failed = judge(f_rows)
        row.update(fixed_pin=pin(entries, fixed_entry), fixed_verdict=f_verdict,
                   fixed_worst_tensor=f_show["worst_tensor"] if f_show else "", fixed_error=error_text(f_show))
        if bug.get("fixed_note"):
            row["fixed_verdict"] += f"; {bug['fixed_note']}"
    else:
        f_failed = None
        row.update(fixed_pin=bug.get("fixed_pin", ""), fixed_verdict="no fixed pin")
    if b_failed is None:
        row["recall"] = "not run"
    elif not b_failed:
        row["recall"] = "missed"
    elif f_failed is None:
        row["recall"] = "caught, no fixed pin"
    else:
        row["recall"] = "fixed pin fails too" if f_failed else "recalled"
    return row


def pin(entries, name):
    if name not in entries:
        raise KeyError(f"no entry {name!r} in implementations.json")
    return f"{entries[name]['library']} {entries[name]['version']}"


def markdown(table):
    recalled = [r for r in table if r["recall"] == "recalled"]
    libraries = sorted({r["library"] for r in recalled})
    reproduced = sum(r["recall"].startswith("reproduced") for r in table)
    lines = ["# Known-bug recall", "",
             f"Generated by `experiments/survey/known_bugs.py` from the survey's rows (`results/survey/survey-*.csv`). "
             f"{len(recalled)} of {len(table)} bugs recalled (failing at the buggy pin, passing at the fixed one), "
             f"from {len(libraries)} librar{'y' if len(libraries) == 1 else 'ies'}"
             f"{': ' + ', '.join(libraries) if libraries else ''}"
             f"{f'; {reproduced} more by a reproduction of their own, before their survey rows' if reproduced else ''}. "
             "Errors: fp64 normwise against the harness's oracle; otherwise the multiple of the low-precision rule's "
             "bar (<= 1 passes; `(common-scale)`: every tensor off by one shared factor, e.g. all zero). Rows whose "
             "setting says \"Triton interpreter\" ran the library's Triton kernels in Triton's CPU interpreter: the "
             "algorithm, not a GPU's numerics.", "",
             "| library | reference | buggy pin | verdict | worst tensor | error | fixed pin | verdict | recall | command |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            r["library"], r["reference"], r.get("buggy_pin", ""), r.get("buggy_verdict", ""),
            f"`{r['worst_tensor']}`" if r.get("worst_tensor") else "", r.get("buggy_error", ""), r.get("fixed_pin", ""),
            r.get("fixed_verdict", ""), r["recall"], f"`{r['command']}`" if r.get("command") else ""))
    lines += ["", "What each bug is, and why one is not caught:", ""]
    for r in table:
        label = "Survey rows needed" if r["recall"].startswith("reproduced") else "Not caught"
        reason = f" **{label}:** {r['reason']}." if r["reason"] else ""
        lines.append(f"- **{r['library']}, {r['reference']}**: {r['bug']}.{reason}")
    commits = sorted({r["commit"] for r in table if r.get("commit")})
    machines = sorted({r["machine"] for r in table if r.get("machine")})
    lines += ["", f"Commits the rows ran at: {', '.join(commits) or '(none)'}. Machines: {'; '.join(machines) or '(none)'}."]
    return "\n".join(lines) + "\n"


def write_atomically(path, text):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--survey", default=str(ROOT / "results" / "survey"))
    parser.add_argument("--bugs", default=str(HERE / "known_bugs.json"))
    parser.add_argument("--manifest", default=str(HERE / "implementations.json"))
    args = parser.parse_args(argv)
    try:
        bugs = json.loads(Path(args.bugs).read_text())
        entries = {e["name"]: e for e in json.loads(Path(args.manifest).read_text())}
        rows = newest_rows(args.survey)
        table = [table_row(bug, rows, entries) for bug in bugs]
    except (OSError, ValueError, KeyError) as e:
        print(f"known_bugs.py: {e}", file=sys.stderr)
        return 2
    out = Path(args.survey)
    with open(out / "known-bugs.csv.tmp", "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(table)
    os.replace(out / "known-bugs.csv.tmp", out / "known-bugs.csv")
    write_atomically(out / "known-bugs.md", markdown(table))
    print(markdown(table))
    bad = [r for r in table if r["recall"] in ("missed", "fixed pin fails too")]
    for r in bad:
        print(f"known_bugs.py: {r['library']} {r['reference']}: {r['recall']}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
