"""A stand-in for the harness binary's `conform` as the pytest plugin drives it (conform_plugin_checks.py): the
plugin's own behaviour checked in milliseconds per case, without the build or torch.

  conform --list-cases ...   prints the cases of the JSON file $FAKE_CONFORM_CASES (each: name, description,
                             objective, dtype; optional "fails": a verdict, as a wrong gradient's), each with its id
  conform --impl CMD --only NAME --junit FILE [--work DIR] ...   runs `CMD DIR/NAME` in a shell as conform does: exit
                             0 passes (unless the case "fails"), 3 is N/A with the last line as the reason, another
                             status fails; the case's directory stays in DIR when it failed; the JUnit report has a
                             testcase per case of that name ($FAKE_CONFORM_JUNIT_TWICE: each twice)
Every command line is appended to $FAKE_CONFORM_LOG as a JSON list.
"""
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path


def option(argv, name, default=None):
    return argv[argv.index(name) + 1] if name in argv else default


def judge(impl, case, work):
    """(status, message) of one case: passed, skipped or failed."""
    case_dir = work / case["name"]
    case_dir.mkdir(parents=True, exist_ok=True)
    with open(case_dir / "impl.log", "w") as log:
        status = subprocess.run(f"{impl} {shlex.quote(str(case_dir))}", shell=True, stdout=log,
                                stderr=subprocess.STDOUT).returncode
    lines = (case_dir / "impl.log").read_text().strip().splitlines()
    last = lines[-1] if lines else ""
    if status == 3:
        return "skipped", f"not expressible: {last}"
    if status != 0:
        return "failed", f"exited with status {status}: {last}"
    if case.get("fails"):
        return "failed", case["fails"]
    return "passed", ""


def main(argv):
    with open(os.environ["FAKE_CONFORM_LOG"], "a") as log:
        log.write(json.dumps(argv) + "\n")
    cases = json.loads(Path(os.environ["FAKE_CONFORM_CASES"]).read_text())
    for case in cases:  # the case id conform lists beside each case and names its JUnit rows by
        case.setdefault("id", f"{case['name']}-{case['dtype']}")
    if "--list-cases" in argv:
        print(json.dumps(cases, indent=2))
        return 0
    only, impl = option(argv, "--only"), option(argv, "--impl")
    given_work = option(argv, "--work")
    work = Path(given_work or tempfile.mkdtemp(prefix="fake-conform-"))
    report = ET.Element("testsuites")
    suite = ET.SubElement(report, "testsuite", name="fake conform")
    verdicts = []
    for case in (c for c in cases if c["name"] == only):
        status, message = judge(impl, case, work)
        verdicts.append(status)
        for _ in range(2 if os.environ.get("FAKE_CONFORM_JUNIT_TWICE") else 1):
            testcase = ET.SubElement(suite, "testcase", classname="streambp.conform." + case["objective"].split(":")[0],
                                     name=case["id"])
            if status != "passed":
                ET.SubElement(testcase, "failure" if status == "failed" else "skipped", message=message)
        if status != "failed" or not given_work:
            shutil.rmtree(work / case["name"])
    ET.ElementTree(report).write(option(argv, "--junit"))
    print(f"\n{verdicts.count('passed')} of {verdicts.count('passed') + verdicts.count('failed')} case(s) passed")
    if "failed" in verdicts:  # conform's words on the failing cases' directories, which the plugin replaces
        print("the failing cases' directories went with the temporary folder; --work DIR keeps them" if not given_work
              else f"the failing cases' directories (inputs, the implementation's output, impl.log): {work}")
    if not given_work:
        shutil.rmtree(work)
    return 1 if "failed" in verdicts or "passed" not in verdicts else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
