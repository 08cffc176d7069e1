"""pytest plugin (entry point pytest11): each `streambp conform` case is a pytest item (issue #47).

    @pytest.mark.streambp_conform(adapter=[sys.executable, "my_adapter.py"], cases="ci")
    def test_my_loss(): ...

or, without a test file, `pytest --streambp-adapter "python my_adapter.py"`. `--streambp-warm`: adapters that call
streambp_conform.warm.delegate() run in workers of one server started in this python (imports once per session).
The harness binary comes from
`--streambp PATH` or the STREAMBP environment variable. Items are named TEST[CASE-DTYPE], so `-k` selects cases; each
runs `streambp conform --only CASE`, so `-x` stops at the first failing case; `--junitxml` gives the CI its file. A
failing item shows conform's verdict line (the worst tensor, its error, the bar, the hint), an N/A case is skipped
with its reason.
"""
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

DOCS = "docs/conform-in-ci.md in the StreamBP harness"
MARKER = "streambp_conform"


def pytest_addoption(parser):
    group = parser.getgroup("streambp-conform", "gradient conformance against the StreamBP harness")
    group.addoption("--streambp", metavar="PATH", help="the harness binary (build/streambp); default: $STREAMBP")
    group.addoption("--streambp-adapter", metavar="CMD", action="append", default=[],
                    help="an adapter command to run the cases on (repeatable); beside @pytest.mark.streambp_conform")
    group.addoption("--streambp-cases", metavar="SET", default="ci", help="case set for --streambp-adapter (ci)")
    group.addoption("--streambp-baseline", metavar="CMD",
                    help="the low-precision cases' yardstick in the same dtype (conform --baseline; default hf)")
    group.addoption("--streambp-warm", action="store_true",
                    help="adapters that call streambp_conform.warm.delegate() run in workers forked from one server "
                         "in this python, their imports done once per session instead of once per case")


def pytest_configure(config):
    config.addinivalue_line("markers", f"{MARKER}(adapter, cases='ci', objectives=None, dtypes=None, baseline=None, "
                            "conform_args=()): run the harness's conformance cases on this adapter command, one "
                            "pytest item per case")


def pytest_sessionstart(session):
    if session.config.getoption("--streambp-warm", default=False):
        session.config._streambp_warm = _start_warm_server()


def pytest_sessionfinish(session):
    server = getattr(session.config, "_streambp_warm", None)
    if server is not None:
        process, folder = server
        process.terminate()
        process.wait()
        session.config._streambp_warm_runs = Path(folder, "serve.log").read_text().count(" worker ")
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(warm.ENV, None)
        session.config._streambp_warm = None


def pytest_terminal_summary(terminalreporter, config):
    runs = getattr(config, "_streambp_warm_runs", None)
    if runs is not None:  # an adapter script without delegate() runs cold: the count says so
        terminalreporter.write_line(f"streambp-conform: {runs} adapter run(s) in warm workers")


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


def _binary(config):
    path = config.getoption("--streambp") or os.environ.get("STREAMBP")
    where = "--streambp" if config.getoption("--streambp") else "STREAMBP"
    if not path:
        raise pytest.UsageError(f"streambp-conform: no harness binary: pass --streambp PATH (or set STREAMBP) to the "
                                f"built build/streambp ({DOCS})")
    resolved = shutil.which(path) or (path if os.access(path, os.X_OK) else None)
    if not resolved:
        raise pytest.UsageError(f"streambp-conform: {where} {path}: no such executable; build the harness "
                                f"(make build) and pass its build/streambp ({DOCS})")
    return str(Path(resolved).resolve())


def _command(adapter):
    return adapter if isinstance(adapter, str) else shlex.join(str(a) for a in adapter)


class ConformSpec:
    """One adapter over one case selection (a marker's arguments, or --streambp-adapter)."""

    def __init__(self, adapter, cases="ci", objectives=None, dtypes=None, baseline=None, conform_args=()):
        self.adapter, self.cases, self.baseline = _command(adapter), str(cases), baseline
        self.filters = []
        if objectives:
            self.filters += ["--objectives", ",".join(objectives)]
        if dtypes:
            self.filters += ["--dtypes", ",".join(dtypes)]
        self.filters += list(conform_args)

    def list_cases(self, binary):
        p = subprocess.run([binary, "conform", "--list-cases", "--cases", self.cases, *self.filters],
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise pytest.UsageError(f"streambp-conform: {binary} conform --list-cases --cases {self.cases}: "
                                    f"{p.stderr.strip() or p.stdout.strip()}")
        return json.loads(p.stdout)


class ConformItem(pytest.Item):
    def __init__(self, *, spec, case, binary, **kwargs):
        super().__init__(**kwargs)
        self.spec, self.case, self.binary = spec, case, binary
        self.verdict = ""

    def runtest(self):
        with tempfile.TemporaryDirectory(prefix="streambp-pytest-") as tmp:
            report = Path(tmp) / "report.xml"
            argv = [self.binary, "conform", "--impl", self.spec.adapter, "--cases", self.spec.cases,
                    *self.spec.filters, "--only", self.case["name"], "--out", str(Path(tmp) / "results"),
                    "--junit", str(report)]
            baseline = self.spec.baseline or self.config.getoption("--streambp-baseline")
            if baseline:
                argv += ["--baseline", _command(baseline)]
            p = subprocess.run(argv, capture_output=True, text=True)
            if not report.exists():  # conform refused the run itself (bad input: exit 2)
                raise ConformFailure(f"streambp conform exited {p.returncode} before judging:\n{p.stderr.strip()}")
            (testcase,) = ET.parse(report).getroot().iter("testcase")
        skipped, failure = testcase.find("skipped"), testcase.find("failure")
        if skipped is not None:
            pytest.skip(skipped.get("message"))
        if failure is not None:
            raise ConformFailure(f"{failure.get('message')}\n{failure.text or ''}\n{_tail(p.stdout)}")

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, ConformFailure):
            return f"{self.case['name']} ({self.case['dtype']}) on {self.spec.adapter}: {excinfo.value}"
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"{self.name}: streambp conform --only {self.case['name']}"


def _tail(stdout):
    """conform's last lines after the table: the failed command's output and how to rerun it."""
    lines = stdout.strip().splitlines()
    after = [i for i, line in enumerate(lines) if "case(s) passed" in line]
    return "\n".join(lines[after[-1] + 1:]) if after else ""


def _items(parent, name, spec, binary):
    return [ConformItem.from_parent(parent, name=f"{name}[{c['name']}-{c['dtype']}]", spec=spec, case=c,
                                    binary=binary)
            for c in spec.list_cases(binary)]


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector, name, obj):
    """A marked test function becomes its cases' items (before pytest's own Function)."""
    marker = next((m for m in getattr(obj, "pytestmark", []) if m.name == MARKER), None) if callable(obj) else None
    if marker is None:
        return None
    spec = ConformSpec(*marker.args, **marker.kwargs)
    try:
        return _items(collector, name, spec, _binary(collector.config))
    except pytest.UsageError as e:  # inside a module's collection: one line, not a traceback into this plugin
        raise pytest.Collector.CollectError(str(e))


class AdapterCollector(pytest.Collector):
    """The items of --streambp-adapter commands (no test file needed)."""

    def collect(self):
        binary = _binary(self.config)
        items = []
        for k, adapter in enumerate(self.config.getoption("--streambp-adapter")):
            spec = ConformSpec(adapter, self.config.getoption("--streambp-cases"))
            items += _items(self, f"conform{k}" if k else "conform", spec, binary)
        return items


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect
def pytest_collection_modifyitems(session, config, items):
    if config.getoption("--streambp-adapter"):
        items += AdapterCollector.from_parent(session, name="streambp-conform").collect()
