"""Checks a `streambp conform --junit` report against the run's CSV (issue #47): the common JUnit schema's shape
(testsuites > testsuite > testcase, with tests/failures/errors/skipped counts that add up), one testcase per CSV row
under a unique classname.name, each failure's message naming the row's worst tensor (when one was judged) and its
bar, each skipped case carrying the CSV's reason.
Usage: junit_check.py REPORT.xml RESULTS.csv"""
import csv
import sys
import xml.etree.ElementTree as ET

report, table = sys.argv[1], sys.argv[2]
root = ET.parse(report).getroot()
assert root.tag == "testsuites", root.tag
(suite,) = root.findall("testsuite")
cases = suite.findall("testcase")
rows = list(csv.DictReader(open(table)))
by_status = {s: sum(r["status"] == s for r in rows) for s in ("passed", "failed", "not expressible")}
for element in (root, suite):
    assert int(element.get("tests")) == len(cases) == len(rows), (element.attrib, len(cases), len(rows))
    assert int(element.get("failures")) == by_status["failed"], (element.attrib, by_status)
    assert int(element.get("skipped")) == by_status["not expressible"], (element.attrib, by_status)
    assert int(element.get("errors")) == 0 and float(element.get("time")) >= 0
names = [f"{c.get('classname')}.{c.get('name')}" for c in cases]
assert len(set(names)) == len(names), names
assert {p.get("name") for p in suite.find("properties")} >= {"commit", "torch_version", "command"}
for case, row in zip(cases, rows):
    assert case.get("name") == row["case"] + "-" + row["dtype"], (case.attrib, row["case"])  # pytest's item id too
    assert case.get("classname") == "streambp.conform." + row["objective"].split(":")[0], case.attrib
    failure, skipped = case.find("failure"), case.find("skipped")
    if row["status"] == "passed":
        assert failure is None and skipped is None, case.attrib
    elif row["status"] == "failed":
        message = failure.get("message")
        assert skipped is None and message and failure.text, case.attrib
        if row["worst_tensor"]:
            assert f"worst tensor '{row['worst_tensor']}'" in message and "bar" in message, message
        else:
            assert row["problem"].split("\n")[0][:40] in message, (message, row["problem"])
    else:
        assert failure is None and row["problem"] in skipped.get("message"), (skipped.attrib, row["problem"])
print(f"ok: {report}: {len(cases)} testcases ({by_status['failed']} failed, {by_status['not expressible']} skipped) "
      f"agree with the CSV")
