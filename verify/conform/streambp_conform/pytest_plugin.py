"""pytest plugin (entry point pytest11): each `streambp conform` case is a pytest item (issue #47).

    @pytest.mark.streambp_conform(adapter=[sys.executable, "my_adapter.py"], cases="ci")
    def test_my_loss(): ...

or, without a test file, `pytest --streambp-adapter "python my_adapter.py"`. The harness binary comes from
`--streambp PATH` or the STREAMBP environment variable. A marker's script path is relative to its test file. Items
are named TEST[CASE-DTYPE], so `-k` selects cases; each runs `streambp conform --only CASE`, so `-x` stops at the
first failing case; `--junitxml` gives the CI its file, the items under conform's own classname
(streambp.conform.OBJECTIVE). A failing item shows conform's verdict line (the worst tensor, its error, the bar, the
hint), an N/A case is skipped with its reason, and a session whose cases were all N/A fails: it judged nothing
(`--streambp-allow-none-judged` lets it pass). `--streambp-warm`: adapters that call streambp_conform.warm.delegate()
run in workers of one server started in this python (imports once per session). `--streambp-work DIR` keeps the
failing cases' directories for a rerun by hand.
"""
import inspect
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from streambp_conform import warm
from streambp_conform.protocol import objective_names

try:  # the junitxml plugin's report, for the items' classname (what its record_xml_attribute fixture writes to)
    from _pytest.junitxml import xml_key
except ImportError:  # a pytest without it: pytest's own classname
    xml_key = None

DOCS = "docs/conform-in-ci.md in the StreamBP harness"
MARKER = "streambp_conform"
ALLOW_NONE_JUDGED = "--streambp-allow-none-judged"


class _State:
    """What the plugin keeps for one session."""

    def __init__(self):
        self.binary = None  # (resolved path, "--streambp PATH" or "STREAMBP PATH" as given), once checked
        self.outcomes = {"passed": 0, "failed": 0, "skipped": 0}  # of the conform items that ran
        self.work_folders = set()  # the names taken under --streambp-work
        self.warm = None  # (process, folder) of --streambp-warm's server
        self.warm_runs = None


STATE = pytest.StashKey[_State]()


def pytest_addoption(parser):
    group = parser.getgroup("streambp-conform", "gradient conformance against the StreamBP harness")
    group.addoption("--streambp", metavar="PATH", help="the harness binary (build/streambp); default: $STREAMBP")
    group.addoption("--streambp-adapter", metavar="CMD", action="append", default=[],
                    help="an adapter command to run the cases on (repeatable); beside @pytest.mark.streambp_conform")
    group.addoption("--streambp-cases", metavar="SET",
                    help="the case set of --streambp-adapter (default ci); given, it also replaces every marker's "
                         "cases= (a nightly job: --streambp-cases full)")
    group.addoption("--streambp-baseline", metavar="CMD",
                    help="the low-precision cases' yardstick in the same dtype (conform --baseline; default hf)")
    group.addoption("--streambp-warm", action="store_true",
                    help="adapters that call streambp_conform.warm.delegate() run in workers forked from one server "
                         "in this python, their imports done once per session instead of once per case")
    group.addoption("--streambp-work", metavar="DIR",
                    help="keep each failing case's directory (its inputs, the adapter's output, impl.log) in "
                         "DIR/TEST/CASE, to rerun it by hand")
    group.addoption(ALLOW_NONE_JUDGED, action="store_true",
                    help="let a session pass whose conform cases were all N/A (skipped); by default it fails, since "
                         "it judged no gradient")


def pytest_configure(config):
    config.addinivalue_line("markers", f"{MARKER}(adapter, cases='ci', objectives=None, dtypes=None, baseline=None, "
                            "conform_args=()): run the harness's conformance cases on this adapter command, one "
                            "pytest item per case")
    config.stash[STATE] = _State()


def pytest_sessionstart(session):
    if session.config.getoption("--streambp-warm", default=False):
        session.config.stash[STATE].warm = _start_warm_server()


def pytest_sessionfinish(session):
    state = session.config.stash[STATE]
    if state.warm is not None:
        process, folder = state.warm
        process.terminate()
        process.wait()
        state.warm_runs = Path(folder, "serve.log").read_text().count(" worker ")
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(warm.ENV, None)
        state.warm = None
    outcomes = state.outcomes
    # Every case N/A passes in pytest's terms, yet no gradient was judged (conform itself exits 1 then).
    if (sum(outcomes.values()) and not outcomes["passed"] + outcomes["failed"]
            and not session.config.getoption(ALLOW_NONE_JUDGED) and session.exitstatus == pytest.ExitCode.OK):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config):
    state = config.stash[STATE]
    if state.warm_runs is not None:  # an adapter script without delegate() runs cold: the count says so
        terminalreporter.write_line(f"streambp-conform: {state.warm_runs} adapter run(s) in warm workers")
    outcomes = state.outcomes
    if not sum(outcomes.values()):
        return
    judged = outcomes["passed"] + outcomes["failed"]
    terminalreporter.write_line(f"streambp-conform: {judged} case(s) judged ({outcomes['passed']} passed, "
                                f"{outcomes['failed']} failed), {outcomes['skipped']} N/A")
    if not judged and not config.getoption(ALLOW_NONE_JUDGED):
        terminalreporter.write_line(f"streambp-conform: no case was judged (every one N/A), so the session fails; "
                                    f"{ALLOW_NONE_JUDGED} allows that", red=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if isinstance(item, ConformItem) and report.when == "call":
        item.config.stash[STATE].outcomes[report.outcome] += 1


def _start_warm_server():
    """The warm server in this python (the adapters' environment), its socket in os.environ for conform's children."""
    folder = tempfile.mkdtemp(prefix="streambp-warm-")
    sock = os.path.join(folder, "warm.sock")
    log = open(os.path.join(folder, "serve.log"), "w")
    process = subprocess.Popen([sys.executable, "-m", "streambp_conform", "serve", sock], stderr=log)
    deadline = time.monotonic() + 300
    while not os.path.exists(sock):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise pytest.UsageError(f"streambp-conform: --streambp-warm: the server did not start: "
                                    f"{Path(folder, 'serve.log').read_text().strip()}")
        time.sleep(0.1)
    os.environ[warm.ENV] = sock
    return process, folder


class ConformFailure(Exception):
    """A case the harness judged failed: its verdict, shown without a traceback."""


def _error(message):
    """A collection error shown as its one line (pytest prints a CollectError's message, no traceback)."""
    return pytest.Collector.CollectError(f"streambp-conform: {message}")


def _binary(config):
    """The harness binary: its resolved path, and the option or variable that named it with its value (for the
    errors)."""
    state = config.stash[STATE]
    if state.binary is None:
        given = config.getoption("--streambp")
        where, path = ("--streambp", given) if given else ("STREAMBP", os.environ.get("STREAMBP"))
        if not path:
            raise _error(f"no harness binary: pass --streambp PATH (or set STREAMBP) to the built build/streambp "
                         f"({DOCS})")
        if os.path.isdir(path):
            raise _error(f"{where} {path}: a directory, not the harness binary (its build/streambp) ({DOCS})")
        resolved = shutil.which(path) or shutil.which(os.path.join(".", path))  # a bare name: PATH, then here
        if not resolved:
            raise _error(f"{where} {path}: no such executable; build the harness (make build) and pass its "
                         f"build/streambp ({DOCS})")
        state.binary = (str(Path(resolved).resolve()), f"{where} {path}")
    return state.binary


def _command(adapter):
    return adapter if isinstance(adapter, str) else shlex.join(str(a) for a in adapter)


def _describe(case, index):
    return f"#{index} {case.get('description') or 'no description'}, {case.get('dtype')}"


def _case_list(text):
    """conform --list-cases's JSON: a list of cases, each with a name, dtype and objective (None: something else)."""
    try:
        cases = json.loads(text)
    except ValueError:
        return None
    keys = {"name", "dtype", "objective"}
    return cases if isinstance(cases, list) and all(isinstance(c, dict) and keys <= c.keys() for c in cases) else None


class ConformSpec:
    """One adapter over one case selection (a marker's arguments, or --streambp-adapter); `work`: where
    --streambp-work keeps its failing cases."""

    def __init__(self, adapter, cases="ci", objectives=None, dtypes=None, baseline=None, conform_args=()):
        self.adapter, self.cases, self.baseline = _command(adapter), str(cases), baseline
        self.filters = []
        if objectives:
            self.filters += ["--objectives", ",".join(sorted(objective_names(objectives)))]
        if dtypes:
            self.filters += ["--dtypes", ",".join(dtypes)]
        self.filters += list(conform_args)
        self.work = None

    def list_cases(self, binary):
        path, given = binary
        argv = [path, "conform", "--list-cases", "--cases", self.cases, *self.filters]
        try:
            p = subprocess.run(argv, capture_output=True, text=True)
        except OSError as e:
            raise _error(f"{given}: cannot run it: {e.strerror} ({DOCS})")
        if p.returncode != 0:
            raise _error(f"{shlex.join(argv)}: {p.stderr.strip() or p.stdout.strip()}")
        cases = _case_list(p.stdout)
        if cases is None:
            lines = p.stdout.strip().splitlines()
            raise _error(f"{given}: `conform --list-cases` printed no case list "
                         f"({repr(lines[0][:60]) if lines else 'nothing'}): is it the harness's build/streambp? "
                         f"({DOCS})")
        seen = {}  # name -> the index of its first case
        for k, c in enumerate(cases):  # an item runs its case by --only NAME: two of one name would be one item
            j = seen.setdefault(c["name"], k)
            if j != k:
                raise _error(f"`streambp {shlex.join(argv[1:])}` lists two cases named {c['name']!r}: "
                             f"{_describe(cases[j], j)} and {_describe(c, k)}; an item runs its case by name, so the "
                             f"names must be unique")
        return cases


class ConformItem(pytest.Item):
    def __init__(self, *, spec, case, binary, **kwargs):
        super().__init__(**kwargs)
        self.spec, self.case, self.binary = spec, case, binary
        # conform's own JUnit classname: either route groups a case alike on a CI's test page
        self.classname = "streambp.conform." + case["objective"].split(":")[0]

    def setup(self):
        xml = self.config.stash.get(xml_key, None) if xml_key is not None else None
        if xml is not None:  # before the first report: the junitxml plugin keeps an attribute given this early
            # its key is the node's id as record_xml_attribute passes it: `id` (pytest 9.2), else `nodeid`
            xml.node_reporter(getattr(self, "id", self.nodeid)).add_attribute("classname", self.classname)

    def runtest(self):
        name = self.case["name"]
        with tempfile.TemporaryDirectory(prefix="streambp-pytest-") as tmp:
            report = Path(tmp) / "report.xml"
            argv = [self.binary, "conform", "--impl", self.spec.adapter, "--cases", self.spec.cases,
                    *self.spec.filters, "--only", name, "--out", str(Path(tmp) / "results"), "--junit", str(report)]
            if self.spec.work is not None:
                argv += ["--work", str(self.spec.work)]
            baseline = self.spec.baseline or self.config.getoption("--streambp-baseline")
            if baseline:
                argv += ["--baseline", _command(baseline)]
            p = subprocess.run(argv, capture_output=True, text=True)
            if not report.exists():  # conform refused the run itself (bad input: exit 2)
                raise ConformFailure(f"streambp conform exited {p.returncode} before judging:\n{p.stderr.strip()}")
            testcases = list(ET.parse(report).getroot().iter("testcase"))
        if len(testcases) != 1:
            raise ConformFailure(f"conform's JUnit report holds {len(testcases)} testcases for --only {name}, not one")
        skipped, failure = testcases[0].find("skipped"), testcases[0].find("failure")
        if skipped is not None:
            pytest.skip(skipped.get("message"))
        if failure is not None:
            raise ConformFailure(f"{failure.get('message')}\n{failure.text or ''}\n{self._after_table(p.stdout)}")

    def _after_table(self, stdout):
        """conform's lines after its table (the failed command's output and python), and where the case's directory
        is: conform's own words on that name its --work, which pytest spells --streambp-work."""
        lines = stdout.strip().splitlines()
        after = [i for i, line in enumerate(lines) if "case(s) passed" in line]
        lines = [line for line in lines[after[-1] + 1:] if not line.startswith("the failing cases' directories")] \
            if after else []
        if self.spec.work is None:
            lines.append("pytest --streambp-work DIR keeps the case's directory (its inputs, the adapter's output, "
                         "impl.log) to rerun it by hand")
        else:
            kept = shlex.quote(str(self.spec.work / self.case["name"]))
            lines.append(f"the case's directory (its inputs, the adapter's output, impl.log): {kept}; rerun it by "
                         f"hand: {self.spec.adapter} {kept}")
        return "\n".join(lines)

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, ConformFailure):
            return f"{self.case['name']} ({self.case['dtype']}) on {self.spec.adapter}: {excinfo.value}"
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"{self.name}: streambp conform --only {self.case['name']}"


def _work_folder(config, name):
    """DIR/TEST under --streambp-work: each test's cases apart, so two adapters running one case do not collide (a
    test name that two files share gets a number)."""
    root = config.getoption("--streambp-work")
    if not root:
        return None
    taken, folder, k = config.stash[STATE].work_folders, name, 1
    while folder in taken:
        k += 1
        folder = f"{name}-{k}"
    taken.add(folder)
    return Path(root).resolve() / folder


def _items(parent, name, spec):
    binary = _binary(parent.config)
    spec.work = _work_folder(parent.config, name)
    return [ConformItem.from_parent(parent, name=f"{name}[{c['id']}]", spec=spec, case=c,
                                    binary=binary[0])
            for c in spec.list_cases(binary)]


def _is_file(path):
    try:
        return path.is_file()
    except OSError:  # a name too long for a file (a `python -c CODE` argument): not one
        return False


def _scripts_beside(adapter, here):
    """A marker's adapter list, its script found beside the test file: CI runs `pytest tests/conform` from the
    repository's root, not from the test's folder. An argument naming a file there becomes that file's path; a .py
    found neither there nor in pytest's working directory fails the collection."""
    out = []
    for arg in map(str, adapter):
        if not arg.startswith("-") and not os.path.isabs(arg) and _is_file(here / arg):
            out.append(str(here / arg))
        elif arg.endswith(".py") and not _is_file(Path(arg)):
            where = "no such file" if os.path.isabs(arg) else \
                f"neither in the test file's directory {here} nor in pytest's working directory {os.getcwd()}"
            raise _error(f"adapter script {arg}: {where}")
        else:
            out.append(arg)
    return out


def _marker_spec(collector, name, marker):
    """A marker's arguments as a spec: its script (and a JSON file of cases) beside the test file, --streambp-cases
    (when given) instead of its cases."""
    here = collector.path.parent
    try:
        args = inspect.signature(ConformSpec).bind(*marker.args, **marker.kwargs).arguments
        if not isinstance(args["adapter"], str):
            args["adapter"] = _scripts_beside(args["adapter"], here)
        cases = str(args.get("cases", "ci"))
        args["cases"] = collector.config.getoption("--streambp-cases") or \
            (str(here / cases) if _is_file(here / cases) else cases)
        return ConformSpec(**args)
    except (TypeError, ValueError) as e:
        raise _error(f"@pytest.mark.{MARKER} on {name}: {e}")


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector, name, obj):
    """A marked test function becomes its cases' items (before pytest's own Function)."""
    marker = next((m for m in getattr(obj, "pytestmark", []) if m.name == MARKER), None) if callable(obj) else None
    if marker is None:
        return None
    return _items(collector, name, _marker_spec(collector, name, marker))


class AdapterCollector(pytest.Collector):
    """The items of --streambp-adapter commands (no test file needed)."""

    def collect(self):
        cases = self.config.getoption("--streambp-cases") or "ci"
        items = []
        for k, adapter in enumerate(self.config.getoption("--streambp-adapter")):
            items += _items(self, f"conform{k}" if k else "conform", ConformSpec(adapter, cases))
        return items


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect
def pytest_collection_modifyitems(session, config, items):
    if config.getoption("--streambp-adapter"):
        # collected as a file's items are: pytest counts them ("collected N items") and reports their errors
        items += session.genitems(AdapterCollector.from_parent(session, name="streambp-conform"))
