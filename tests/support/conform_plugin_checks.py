"""The streambp_conform package's own behaviour, mostly against a stand-in harness (fake_conform.py): the pytest
plugin's collection, verdicts, options and errors, the adapter side's objectives, result.json, the warm server's
environment check and streambp_conform.hf. Run by tests/cli/cli_conform_pytest.sh in the user-like venv:
  PYTHONPATH=verify/conform python -m pytest -p pytester conform_plugin_checks.py
with CONFORM_OTHER_PYTHON a python of another environment (the harness's). Each pytest run below is in-process: no
python start, no build, no torch but in the last two checks."""
import json
import os
import shlex
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from streambp_conform import protocol

FAKE = Path(__file__).resolve().with_name("fake_conform.py")
PLUGIN = ("-p", "no:streambp_conform", "-p", "streambp_conform.pytest_plugin")  # the checkout's, installed or not


def case(name, objective="sft", dtype="fp64", **more):
    return {"name": name, "description": f"the case {name}", "objective": objective, "dtype": dtype, **more}


class Harness:
    """A fake build/streambp in the test's folder; `run` is pytest on the test files there, with the plugin."""

    def __init__(self, pytester, monkeypatch):
        self.pytester, self.root = pytester, pytester.path
        self.binary = self.root / "streambp"
        self.binary.write_text(f"#!{sys.executable} -IS\nimport runpy\n"  # -IS: the standard library only, sooner
                               f"runpy.run_path({str(FAKE)!r}, run_name='__main__')\n")
        self.binary.chmod(0o755)
        monkeypatch.setenv("FAKE_CONFORM_CASES", str(self.root / "cases.json"))
        monkeypatch.setenv("FAKE_CONFORM_LOG", str(self.root / "conform.log"))
        monkeypatch.delenv("STREAMBP", raising=False)
        self.cases(case("sft-a"), case("sft-b"))

    def cases(self, *cases):
        (self.root / "cases.json").write_text(json.dumps(cases))

    def test_file(self, body, path="test_conform.py"):
        file = self.root / path
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text("import sys, pytest\n" + textwrap.dedent(body))

    def run(self, *args, binary=True):
        result = self.pytester.runpytest(*PLUGIN, *(("--streambp", str(self.binary)) if binary else ()), *args)
        result.text = "\n".join(result.outlines + result.errlines)
        return result

    def calls(self):
        """The fake's command lines: the runs (not --list-cases)."""
        lines = (self.root / "conform.log").read_text().splitlines()
        return [argv for argv in map(json.loads, lines) if "--list-cases" not in argv]


@pytest.fixture
def harness(pytester, monkeypatch):
    return Harness(pytester, monkeypatch)


PASSES = "adapter=['true']"  # a marker's adapter that passes every case (the fake judges its exit status)
NA = "adapter=['sh', '-c', 'echo no such thing; exit 3']"  # and one that declares every case N/A


def says(result, *lines):
    for line in lines:
        assert line in result.text, f"no {line!r} in:\n{result.text}"


def no_traceback(result):
    assert "Traceback" not in result.text and "pytest_plugin.py" not in result.text, result.text


# Case names and reports
def test_duplicate_case_names_fail_collection_naming_both(harness):
    harness.cases(case("sft-a"), case("sft-a", dtype="bf16", description="the other one"))
    harness.test_file(f"@pytest.mark.streambp_conform({PASSES})\ndef test_loss(): pass\n")
    result = harness.run()
    assert result.ret != 0
    says(result, "lists two cases named 'sft-a': #0 the case sft-a, fp64 and #1 the other one, bf16;"
                 " an item runs its case by name, so the names must be unique")
    assert "too many values" not in result.text
    no_traceback(result)


def test_a_report_without_exactly_one_testcase_is_one_line(harness, monkeypatch):
    monkeypatch.setenv("FAKE_CONFORM_JUNIT_TWICE", "1")
    harness.test_file(f"@pytest.mark.streambp_conform({PASSES})\ndef test_loss(): pass\n")
    result = harness.run("-k", "sft-a")
    result.assert_outcomes(failed=1, deselected=1)
    says(result, "conform's JUnit report holds 2 testcases for --only sft-a, not one")
    assert "too many values" not in result.text
    no_traceback(result)


# Objectives, and sessions that judge nothing
def test_marker_objectives_any_case_and_unknown_named(harness):
    harness.test_file(f"@pytest.mark.streambp_conform({PASSES}, objectives=['SFT', 'Dpo'])\ndef test_loss(): pass\n")
    harness.run().assert_outcomes(passed=2)
    assert all(argv[argv.index("--objectives") + 1] == "dpo,sft" for argv in harness.calls())
    harness.test_file(f"@pytest.mark.streambp_conform({PASSES}, objectives=['sftx'])\ndef test_loss(): pass\n")
    result = harness.run()
    assert result.ret != 0
    says(result, "@pytest.mark.streambp_conform on test_loss: objectives ['sftx']: unknown sftx "
                 "(valid: sft, grpo, dpo; None: any)")
    no_traceback(result)


def test_a_session_of_only_na_cases_fails_unless_allowed(harness):
    harness.test_file(f"@pytest.mark.streambp_conform({NA})\ndef test_loss(): pass\n")
    result = harness.run()
    assert result.ret == 1, result.text
    result.assert_outcomes(skipped=2)
    says(result, "streambp-conform: 0 case(s) judged (0 passed, 0 failed), 2 N/A",
                 "streambp-conform: no case was judged (every one N/A), so the session fails; "
                 "--streambp-allow-none-judged allows that")
    result = harness.run("--streambp-allow-none-judged")
    assert result.ret == 0, result.text
    assert "no case was judged" not in result.text
    harness.test_file(f"@pytest.mark.streambp_conform({PASSES})\ndef test_ok(): pass\n"
                      f"@pytest.mark.streambp_conform({NA})\ndef test_na(): pass\n")
    result = harness.run()
    assert result.ret == 0, result.text
    says(result, "streambp-conform: 2 case(s) judged (2 passed, 0 failed), 2 N/A")


def write_case(folder, objective="sft", micro_batches=None):
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"protocol": protocol.PROTOCOL, "case": folder.name, "dtype": "float64", "objective": {"name": objective}}
    if micro_batches:
        meta["micro_batches"] = micro_batches
    (folder / "case.json").write_text(json.dumps(meta))
    return folder


def test_run_reads_objectives_in_any_case_and_names_an_unknown_one(tmp_path, capsys):
    def step(_):
        raise AssertionError("declined before the step")

    # SFT is sft: the case gets past the objective to the next reason (torch is never loaded on this path)
    micro = str(write_case(tmp_path / "micro", micro_batches=[[0], [1]]))
    assert protocol.run(step, [micro], objectives={"SFT"}) == protocol.NOT_EXPRESSIBLE
    assert "2 micro-batches: this adapter runs one batch" in capsys.readouterr().err
    dpo = str(write_case(tmp_path / "dpo", objective="dpo"))
    assert protocol.run(step, [dpo], objectives={"SFT"}) == protocol.NOT_EXPRESSIBLE
    assert "objective dpo: this adapter implements SFT only" in capsys.readouterr().err
    assert protocol.run(step, [dpo], objectives={"sft", "bogus"}) == protocol.BAD_CASE
    assert "run(objectives=...): objectives ['bogus', 'sft']: unknown bogus (valid: sft, grpo, dpo" in \
        capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown bogus"):
        protocol.read_case(dpo, objectives=["bogus"])


# The adapter's script, beside the test file
def test_a_marker_script_and_case_file_are_found_beside_its_test_file(harness):
    harness.test_file("raise SystemExit(0)\n", "tests/conform/adapter.py")
    (harness.root / "tests/conform/mine.json").write_text("[]")
    harness.test_file("@pytest.mark.streambp_conform(adapter=[sys.executable, 'adapter.py'], cases='mine.json')\n"
                      "def test_loss(): pass\n", "tests/conform/test_gradients.py")
    harness.run("tests/conform").assert_outcomes(passed=2)  # from the repository's root, as CI runs it
    assert all(str(harness.root / "tests/conform/adapter.py") in argv[argv.index("--impl") + 1] and
               argv[argv.index("--cases") + 1] == str(harness.root / "tests/conform/mine.json")
               for argv in harness.calls())
    harness.test_file("@pytest.mark.streambp_conform(adapter=[sys.executable, 'missing.py'])\ndef test_loss(): pass\n",
                      "tests/conform/test_gradients.py")
    result = harness.run("tests/conform")
    assert result.ret != 0
    says(result, f"adapter script missing.py: neither in the test file's directory "
                 f"{harness.root / 'tests/conform'} nor in pytest's working directory {harness.root}")
    no_traceback(result)


# --streambp-work
def test_streambp_work_keeps_each_tests_case_apart(harness):
    command = ["sh", "-c", "echo it broke; exit 1"]
    fails = f"adapter={command!r}"
    harness.test_file(f"@pytest.mark.streambp_conform({fails})\ndef test_one(): pass\n"
                      f"@pytest.mark.streambp_conform({fails})\ndef test_two(): pass\n")
    result = harness.run("-k", "sft-a")
    result.assert_outcomes(failed=2, deselected=2)
    says(result, "exited with status 1: it broke",
                 "pytest --streambp-work DIR keeps the case's directory (its inputs, the adapter's "
                 "output, impl.log) to rerun it by hand")
    assert "--work DIR keeps them" not in result.text  # conform's own option is not pytest's
    work = harness.root / "kept"
    result = harness.run("-k", "sft-a", "--streambp-work", str(work))
    result.assert_outcomes(failed=2, deselected=2)
    for test in ("test_one", "test_two"):
        kept = work / test / "sft-a"
        assert (kept / "impl.log").read_text().strip() == "it broke"
        says(result, f"the case's directory (its inputs, the adapter's output, impl.log): {kept}; "
                     f"rerun it by hand: {shlex.join(command)} {kept}")
    assert sorted(argv[argv.index("--work") + 1] for argv in harness.calls()[-2:]) == \
        [str(work / "test_one"), str(work / "test_two")]


# Collection, options, the binary, JUnit
def test_adapter_items_are_counted_as_collected(harness):
    adapter = "true"
    result = harness.run("--streambp-adapter", adapter)
    says(result, "collected 2 items")
    result.assert_outcomes(passed=2)
    harness.test_file(f"@pytest.mark.streambp_conform({PASSES})\ndef test_loss(): pass\n")
    result = harness.run("--streambp-adapter", adapter, "-k", "not sft-b")
    says(result, "collected 4 items / 2 deselected / 2 selected")
    result.assert_outcomes(passed=2, deselected=2)


def test_streambp_cases_replaces_the_markers_cases(harness):
    harness.test_file(f"@pytest.mark.streambp_conform({PASSES}, cases='quick')\ndef test_loss(): pass\n")
    harness.run("--streambp-cases", "full").assert_outcomes(passed=2)
    harness.run().assert_outcomes(passed=2)
    harness.pytester.mkdir("no_tests")
    harness.run("--streambp-adapter", "true", "no_tests").assert_outcomes(passed=2)
    assert [argv[argv.index("--cases") + 1] for argv in harness.calls()] == ["full"] * 2 + ["quick"] * 2 + ["ci"] * 2


def test_a_binary_that_is_not_the_harness_is_one_line(harness, monkeypatch):
    harness.test_file(f"@pytest.mark.streambp_conform({PASSES})\ndef test_loss(): pass\n")
    for args, line in ((("--streambp", str(harness.root)), f"--streambp {harness.root}: a directory, not the harness "
                                                           "binary (its build/streambp)"),
                       (("--streambp", "/bin/true"), "--streambp /bin/true: `conform --list-cases` printed no case "
                                                     "list (nothing): is it the harness's build/streambp?"),
                       ((), "no harness binary: pass --streambp PATH (or set STREAMBP)")):
        result = harness.run(*args, binary=False)
        assert result.ret != 0
        says(result, f"streambp-conform: {line}")
        assert "PermissionError" not in result.text and "JSONDecodeError" not in result.text, result.text
        no_traceback(result)
    monkeypatch.setenv("STREAMBP", str(harness.root))
    says(harness.run(binary=False), f"streambp-conform: STREAMBP {harness.root}: a directory")


def test_junit_classname_is_conforms(harness):
    harness.cases(case("grpo-a", objective="grpo:beta=0.04"), case("sft-b", fails="worst tensor 'model.x': 1e-3"))
    harness.test_file(f"@pytest.mark.streambp_conform({PASSES})\ndef test_loss(): pass\n")
    harness.run("--junitxml", "conform.xml").assert_outcomes(passed=1, failed=1)
    testcases = {c.get("name"): c.get("classname")
                 for c in ET.parse(harness.root / "conform.xml").getroot().iter("testcase")}
    assert testcases == {"test_loss[grpo-a-fp64]": "streambp.conform.grpo",
                         "test_loss[sft-b-fp64]": "streambp.conform.sft"}, testcases


# Warm starts, result.json, streambp_conform.hf (real processes)
def test_warm_server_declines_another_python_environment(tmp_path):
    other = os.environ["CONFORM_OTHER_PYTHON"]
    env = {**os.environ, "PYTHONPATH": str(Path(protocol.__file__).parents[1])}
    sock = tmp_path / "warm.sock"
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "streambp_conform", "serve", str(sock), "json"], stderr=log,
                              env=env)
    try:
        for _ in range(600):
            if sock.exists():
                break
            time.sleep(0.05)
        script = tmp_path / "adapter.py"
        script.write_text("from streambp_conform.warm import delegate, in_worker\ndelegate()\nimport sys\n"
                          "print(in_worker(), sys.prefix)\n")
        env["STREAMBP_CONFORM_WARM"] = str(sock)
        ran = {python: subprocess.run([python, str(script)], env=env, capture_output=True, text=True)
               for python in (sys.executable, other)}
    finally:
        server.terminate()
        server.wait()
    assert ran[sys.executable].stdout == f"True {sys.prefix}\n", ran  # delegated: it ran in a worker
    cold, prefix = ran[other].stdout.split()
    assert cold == "False" and prefix != sys.prefix, ran  # declined: cold, in its own environment
    served = (tmp_path / "serve.log").read_text()
    assert served.count(" worker ") == 1 and "declined" in served and "is not this server's" in served, served


def test_result_json_names_the_python_and_torch(tmp_path):
    import torch
    from safetensors.torch import save_file

    folder = write_case(tmp_path / "case")
    save_file({"input_ids": torch.zeros(1, 2, dtype=torch.long), "attention_mask": torch.ones(1, 2, dtype=torch.long)},
              str(folder / "batch.safetensors"))
    assert protocol.run(lambda c: (0.5, {"w": torch.ones(2, dtype=torch.float64)}), [str(folder)]) == 0
    result = json.loads((folder / "result.json").read_text())
    assert result["python"] == sys.executable and result["torch_version"] == torch.__version__, result
    assert result["loss"] == 0.5 and "seconds" in result, result


def test_fp64_exact_keeps_fp64_and_changes_nothing_else(monkeypatch):
    import torch

    from streambp_conform import hf

    classes = hf.norm_classes()
    assert [c.__name__ for c in classes] == ["Qwen3RMSNorm", "Qwen2RMSNorm", "LlamaRMSNorm"]
    shipped = {cls: cls.forward for cls in classes}
    for cls in classes:
        monkeypatch.setattr(cls, "forward", cls.forward)  # restored afterwards
    torch.manual_seed(0)
    x = torch.randn(3, 5, 64, dtype=torch.float64)

    def exact(norm, x):
        return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))

    for cls in classes:
        norm = cls(64).double()
        torch.nn.init.normal_(norm.weight)
        model = torch.nn.Sequential(norm)
        assert hf.fp64_exact(model) is model and cls.forward is shipped[cls]  # this model's norms only
        assert torch.equal(norm(x), exact(norm, x))
        assert (shipped[cls](norm, x) - exact(norm, x)).abs().max() > 1e-12  # what fp64 cases failed on
    for _ in range(2):  # the classes; again: the same
        assert hf.fp64_exact() is None and all(cls.forward is hf.rms_norm_forward for cls in classes)
    for cls in classes:
        norm = cls(64)
        torch.nn.init.normal_(norm.weight)
        assert torch.equal(norm(x), exact(norm, x))
        for dtype in (torch.float32, torch.bfloat16):  # as HF ships them
            low = norm.to(dtype)
            assert torch.equal(low(x.to(dtype)), shipped[cls](low, x.to(dtype)))


def test_packed_cases_are_declined_unless_declared_and_give_both_boundary_forms(tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    from streambp_conform import hf

    # two rows of 6: [2, 3] then a pad; [1, 5]. position_ids restart per segment, the pad a segment of its own
    position_ids = torch.tensor([[0, 1, 0, 1, 2, 0], [0, 0, 1, 2, 3, 4]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1] * 6])
    folder = write_case(tmp_path / "packed")
    meta = json.loads((folder / "case.json").read_text())
    meta.update(packed=True, sequences=[[2, 3], [1, 5]], max_length=5, micro_batches=[[1], [0]])
    (folder / "case.json").write_text(json.dumps(meta))
    cu = protocol.cu_seqlens_from_position_ids(position_ids)
    assert cu.tolist() == [0, 2, 5, 6, 7, 12] and cu.dtype == torch.int32
    assert torch.equal(protocol.position_ids_from_cu_seqlens(cu, 2, 6), position_ids)
    batch = {"input_ids": torch.arange(12).reshape(2, 6), "attention_mask": mask, "labels": torch.zeros(2, 6).long()}
    save_file({**batch, "position_ids": position_ids, "cu_seqlens": cu}, str(folder / "batch.safetensors"))

    def step(_):
        raise AssertionError("declined before the step")

    assert protocol.run(step, [str(folder)], accumulates=True) == protocol.NOT_EXPRESSIBLE
    assert "4 sequences in 2 rows): this adapter does not declare packed rows: run(..., packs=True)" in \
        capsys.readouterr().err
    case = protocol.read_case(folder, accumulates=True)  # read_case: packs=True
    assert case.packed and case.sequences == [[2, 3], [1, 5]] and case.max_length == 5
    assert torch.equal(case.cu_seqlens, cu) and torch.equal(case.position_ids, position_ids)
    assert "cu_seqlens" not in case.batch  # not per row: micro_case could not cut it
    part = protocol.micro_case(case, [1])
    assert part.cu_seqlens.tolist() == [0, 1, 6] and part.sequences == [[1, 5]] and part.max_length == 5
    inputs = hf.model_inputs(case, [0])
    assert set(inputs) == {"input_ids", "position_ids", "use_cache"} and torch.equal(inputs["position_ids"],
                                                                                    position_ids[:1])
    # the file's two forms must agree; one form alone is enough
    save_file({**batch, "position_ids": position_ids, "cu_seqlens": torch.tensor([0, 3, 5, 6, 7, 12]).int()},
              str(folder / "batch.safetensors"))
    with pytest.raises(protocol.CaseError, match="cu_seqlens and position_ids describe different sequences"):
        protocol.read_case(folder, accumulates=True)
    save_file({**batch, "cu_seqlens": cu}, str(folder / "batch.safetensors"))
    assert torch.equal(protocol.read_case(folder, accumulates=True).position_ids, position_ids)
    assert set(hf.model_inputs(protocol.read_case(tmp_path / "packed", accumulates=True))) >= {"position_ids"}


def test_packed_grpo_cases_are_declared_by_name_and_cut_per_sequence(tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    from streambp_conform import hf

    # two full rows of 6, GRPO's packed layout: [2, 4] and [3, 1, 2]; one advantage per sequence (5), cu_seqlens order
    position_ids = torch.tensor([[0, 1, 0, 1, 2, 3], [0, 1, 2, 0, 0, 1]])
    folder = write_case(tmp_path / "packed-grpo", objective="grpo")
    meta = json.loads((folder / "case.json").read_text())
    meta.update(packed=True, sequences=[[2, 4], [3, 1, 2]], max_length=4, per_sequence=["advantages"],
                micro_batches=[[1], [0]])
    (folder / "case.json").write_text(json.dumps(meta))
    advantages = torch.tensor([0.5, -1.0, 2.0, 0.25, -0.75], dtype=torch.float64)
    batch = {"input_ids": torch.arange(12).reshape(2, 6), "attention_mask": torch.ones(2, 6).long(),
             "completion_mask": (position_ids > 0).long(), "advantages": advantages}
    save_file({**batch, "position_ids": position_ids}, str(folder / "batch.safetensors"))

    def step(_):
        raise AssertionError("declined before the step")

    # packs=True is SFT's packed rows, as when adapters first declared it: packed GRPO is declared by name
    for packs in (True, False, ("sft",)):
        assert protocol.run(step, [str(folder)], accumulates=True, packs=packs) == protocol.NOT_EXPRESSIBLE
        assert "5 sequences in 2 rows, one completion and advantage each): this adapter does not declare packed " \
               "GRPO rows: run(..., packs=(\"sft\", \"grpo\"))" in capsys.readouterr().err
    with pytest.raises(protocol.NotExpressible, match="packed GRPO rows"):
        protocol.read_case(folder, accumulates=True)  # read_case's default packs=True: SFT's
    assert protocol.run(step, [str(folder)], accumulates=True, packs="dpo") == protocol.BAD_CASE
    assert "run(packs=...): packs ['dpo']: dpo has no packed layout" in capsys.readouterr().err
    # the objective first: an SFT-only adapter says so rather than naming packing
    assert protocol.run(step, [str(folder)], accumulates=True, objectives="sft", packs=True) == protocol.NOT_EXPRESSIBLE
    assert "objective grpo: this adapter implements SFT only" in capsys.readouterr().err

    case = protocol.read_case(folder, accumulates=True, packs=("sft", "grpo"))
    assert case.per_sequence == ("advantages",) and torch.equal(case.batch["advantages"], advantages)
    assert case.sequence_ids.tolist() == [[0, 0, 1, 1, 1, 1], [2, 2, 2, 3, 4, 4]]
    part = protocol.micro_case(case, [1])  # row 1's three sequences take their advantages with them
    assert part.batch["advantages"].tolist() == [2.0, 0.25, -0.75] and part.sequence_ids.tolist() == [[0, 0, 0, 1, 2, 2]]
    assert torch.equal(part.union["advantages"], advantages)  # the step's batch whole
    assert set(hf.model_inputs(case, [1])) == {"input_ids", "position_ids", "use_cache"}
    # a per-sequence tensor of another length (one per row, as a padded case has them) is a bad case, named
    save_file({**batch, "advantages": advantages[:2], "position_ids": position_ids}, str(folder / "batch.safetensors"))
    with pytest.raises(protocol.CaseError, match=r"'advantages' is per packed sequence \(case.json per_sequence\): "
                                                 r"shape \(2,\), expected \(5,\)"):
        protocol.read_case(folder, accumulates=True, packs=("sft", "grpo"))
