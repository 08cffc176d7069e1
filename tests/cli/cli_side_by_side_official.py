"""The side by side with the paper's code (experiments/hf_side_by_side, --peer official) checks its loss and refuses
what it cannot run, without the paper's code, its venv or a network:
(a) official_train_step.loss_normaliser says what the official SFT loss is on a batch, next to the mean over the
    targets: (T - 1) / T at B = 1 without masking; targets / labels on right-padded rows whose head chunks all start
    on a target; no single factor (null) when a chunk starts on a masked prompt. Negative control: that masked chunk
    is named, with its weight and its targets;
(b) paired_runs.loss_check passes the official loss when it is ours times that factor, to rounding, and HF's when it
    is ours. Negative control: the official loss taken as ours (the factor forgotten: 1/T off at T = 64) is a
    MISMATCH, and so is a 1e-4 error; no factor is "not comparable", never "ok";
(c) paired_runs.py --peer official without STREAMBP_OFFICIAL_SRC, or with a checkout at another commit, exits 2 with
    a message naming the variable (or the pinned commit) and creates no --out; so does a peer interpreter that cannot
    import torch and transformers (--python /bin/false), naming it;
(d) paired_runs.peak_floor is the load-only baseline plus the gradients and AdamW's two states: 12 bytes a parameter
    in fp32, 6 in bf16. At 2026-12-03's T = 8192 run (baseline 865,886,208 B, 102,966,784 parameters, the paper's
    peak 4,154,286,080 B) it is 0.506 of the peer's peak, above the goal's 0.5. Negative control: a floor without one
    of the states would be 0.407 and the goal would look reachable.

Usage: python tests/cli/cli_side_by_side_official.py BUILD/streambp   (the binary is not used)
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SIDE = ROOT / "experiments" / "hf_side_by_side"
sys.path.insert(0, str(SIDE))
import official_train_step  # noqa: E402
import paired_runs  # noqa: E402


def normaliser_facts():
    failures = []
    plain = torch.arange(10).view(1, 10)
    got = official_train_step.loss_normaliser(plain, 4)
    if (got["divisor"], got["targets"], got["loss_over_target_mean"]) != (10, 9, 0.9):
        failures.append(f"B=1 T=10 unmasked: {got}, wanted divisor 10, targets 9, factor 0.9")
    padded = torch.arange(18).view(2, 9)
    padded[1, 7:] = -100  # right padding: every chunk still starts on a target
    got = official_train_step.loss_normaliser(padded, 4)
    if (got["divisor"], got["targets"], got["loss_over_target_mean"]) != (16, 14, 14 / 16):
        failures.append(f"B=2 T=9 padded: {got}, wanted divisor 16, targets 14, factor 14/16")
    prompt = torch.arange(10).view(1, 10)
    prompt[0, :3] = -100  # chunk [0, 5): labels 3, 4 count 2 - B = 1, its targets (positions 1..4) are 2
    got = official_train_step.loss_normaliser(prompt, 4)
    wanted = [{"start": 0, "weight": 1, "targets": 2}]
    if got["loss_over_target_mean"] is not None or got["mismatched_chunks"] != wanted:
        failures.append(f"negative control: a chunk starting on a masked prompt is not named: {got}")
    return failures


def loss_checks():
    failures = []
    ours, T = 6.25942850112915, 64
    cases = [("hf", "fp32", ours, None, "ok"),
             ("official", "fp32", ours * (T - 1) / T * (1 + 1e-7), {"loss_over_target_mean": (T - 1) / T}, "ok"),
             ("official", "bf16", ours * (T - 1) / T * (1 + 1e-3), {"loss_over_target_mean": (T - 1) / T}, "ok"),
             # negative controls
             ("official", "fp32", ours, {"loss_over_target_mean": (T - 1) / T}, "MISMATCH"),
             ("official", "fp32", ours * (T - 1) / T * (1 + 1e-4), {"loss_over_target_mean": (T - 1) / T}, "MISMATCH"),
             ("hf", "fp32", ours * (1 + 1e-4), None, "MISMATCH"),
             ("official", "fp32", ours, {"loss_over_target_mean": None}, "not comparable")]
    for peer, dtype, theirs, normaliser, wanted in cases:
        got = paired_runs.loss_check(peer, dtype, ours, theirs, normaliser)["loss_check"]
        if not got.startswith(wanted):
            failures.append(f"loss_check({peer}, {dtype}, ours {ours}, theirs {theirs}, {normaliser}) = {got!r}, "
                            f"wanted {wanted!r}")
    return failures


def floor_facts():
    failures = []
    for dtype, per_parameter in (("fp32", 12), ("bf16", 6)):
        got = paired_runs.peak_floor(1000, 10, dtype)
        if got != 1000 + 10 * per_parameter:
            failures.append(f"peak_floor(1000, 10, {dtype}) = {got}, wanted {1000 + 10 * per_parameter}")
    baseline, parameters, peer_peak = 865886208, 102966784, 4154286080
    ratio = paired_runs.peak_floor(baseline, parameters, "fp32") / peer_peak
    if not 0.505 < ratio < 0.507:
        failures.append(f"2026-12-03's floor ratio {ratio:.4f}, wanted 0.506")
    one_state = (baseline + 8 * parameters) / peer_peak  # negative control: a state forgotten
    if one_state > 0.5 or ratio <= 0.5:
        failures.append(f"the floor does not tell a reachable goal from an unreachable one: {ratio:.3f}, "
                        f"{one_state:.3f} without a state")
    return failures


def refusals():
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        wrong = Path(tmp, "checkout")
        wrong.mkdir()
        (wrong / "COMMIT").write_text("0000000000000000000000000000000000000000\n")
        out = Path(tmp, "out")
        for source, words in ((None, "STREAMBP_OFFICIAL_SRC"), (str(wrong), "3b56c16")):
            env = {k: v for k, v in os.environ.items() if k != "STREAMBP_OFFICIAL_SRC"}
            if source:
                env["STREAMBP_OFFICIAL_SRC"] = source
            done = subprocess.run([sys.executable, str(SIDE / "paired_runs.py"), "unused-binary", "--peer", "official",
                                   "--out", str(out)], env=env, capture_output=True, text=True)
            if done.returncode != 2 or words not in done.stderr or out.exists():
                failures.append(f"--peer official, STREAMBP_OFFICIAL_SRC={source}: exit {done.returncode}, "
                                f"--out made: {out.exists()}, stderr {done.stderr[-300:]!r} (wanted 2 naming {words})")
        # A peer interpreter without torch and transformers (here one that exits 1: the system python of a machine
        # whose only torch is the venv's) is named with the way out, before --out is made.
        done = subprocess.run([sys.executable, str(SIDE / "paired_runs.py"), "unused-binary", "--python", "/bin/false",
                               "--out", str(out)], capture_output=True, text=True)
        if done.returncode != 2 or "/bin/false cannot import torch" not in done.stderr or out.exists():
            failures.append(f"--python /bin/false: exit {done.returncode}, --out made: {out.exists()}, "
                            f"stderr {done.stderr[-300:]!r} (wanted 2 naming the interpreter)")
    return failures


def main():
    failures = normaliser_facts() + loss_checks() + floor_facts() + refusals()
    for f in failures:
        print("FAIL:", f)
    print(f"{'FAILED' if failures else 'passed'}: official loss normaliser, loss check, peak floor, refusals")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
