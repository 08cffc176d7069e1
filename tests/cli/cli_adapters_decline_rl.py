"""The adapters that read case.json themselves, before the package's read_case or before torchrun (which reports a
rank's exit 3 as 1), report a whole RL step (kind rl_step, conform --cases rl / rl-verl) N/A: exit 3 with a reason
naming the case, not a crash or another case's reason (issue #60). Each launcher runs on a case directory that holds
case.json alone (no model/, no batch), so the refusal must come before anything else is read: an adapter that got
past it fails at once, before torchrun starts (the whole test: about 1 s; none imports torch before its refusal).
Its negative control: streambp_conform.protocol.declines_rl_step leaves a batch case (kind batch, or no kind, as
files before the protocol had kinds) to the adapter, and STREAMBP_TEST_RL_KIND=batch writes the fake case as a batch:
every launcher then goes past the RL refusal and the test fails naming it.

Usage: python tests/cli/cli_adapters_decline_rl.py BUILD/streambp   (the binary is not used)
"""
# ctest-fault: cli_adapters_decline_rl_fault STREAMBP_TEST_RL_KIND=batch did not decline the RL step
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFORM = ROOT / "verify" / "conform"
sys.path.insert(0, str(CONFORM))
from streambp_conform.protocol import NOT_EXPRESSIBLE, declines_rl_step  # noqa: E402

LAUNCHERS = [[CONFORM / "hf_sp_adapter.py"], [CONFORM / "survey" / "verl_ulysses.py"],
             [CONFORM / "survey" / "deepspeed_ulysses.py"], [CONFORM / "survey" / "ms_swift_sp.py"],
             [CONFORM / "survey" / "hf_trainer_sp.py", "--zero=2"], [CONFORM / "survey" / "arctic_sft.py", "--zero=2"]]


def fake_case(root, kind):
    case = root / "rl-dapo-group-ga2"
    case.mkdir(parents=True)
    meta = {"protocol": "streambp-conform/1", "dtype": "float64", "objective": {"name": "grpo", "loss_type": "dapo"},
            "rl_step": {"prompts": [[5]], "completions": [[1], [2, 1]], "rewards": [[1.0], [0.0]], "settings": {}}}
    if kind:
        meta["kind"] = kind
    (case / "case.json").write_text(json.dumps(meta))
    return case


def main():
    failures = []
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        for kind in ("batch", None):  # the helper's own control: a batch case is the adapter's to read
            if declines_rl_step(fake_case(root / f"batch-{kind}", kind)) is not None:
                failures.append(f"declines_rl_step declined a batch case (kind {kind!r})")
        case = fake_case(root / "rl", os.environ.get("STREAMBP_TEST_RL_KIND", "rl_step"))
        for launcher in LAUNCHERS:
            cmd = [sys.executable, str(launcher[0]), *launcher[1:], str(case)]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                failures.append(f"{launcher[0].name}: did not decline the RL step (still running after 60 s)")
                continue
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            if done.returncode != NOT_EXPRESSIBLE or "a whole RL step" not in last or case.name not in last:
                failures.append(f"{launcher[0].name}: did not decline the RL step: exit {done.returncode}, {last}")
            else:
                print(f"{launcher[0].name}: N/A: {last}")
    for f in failures:
        print(f"FAIL {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
