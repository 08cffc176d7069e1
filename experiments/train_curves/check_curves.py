"""Judges issue #19's bf16 training curves (bf16_curves.sh): at every step s, StreamBP's distance to the fp32
trajectory is at most 1.5x standard BP's distance in the same precision *so far* (its largest over steps <= s) plus
the loss's own rounding floor, u * L / sqrt(N) (u = 2^-8, bf16's unit roundoff; L the fp32 run's loss; N the step's
target tokens: the mean of N terms whose logits each carry a relative rounding of u). The gradient rule's factor
(verify/grad_compare.h), applied to losses. Standard's envelope, not its distance at step s: two trajectories that
drift apart by rounding cross each other, and at a crossing standard's distance is 0 by chance (mixed precision,
step 39 of the first run: a per-step ratio of 3.2 where StreamBP's final loss is the nearer of the two to fp32's).

Usage: python experiments/train_curves/check_curves.py OUT   (exit 1 when a step breaks the rule)
"""
import csv
import math
import sys
from pathlib import Path

U = 2.0**-8
FACTOR = 1.5


def read(path: Path):
    return {int(r["step"]): r for r in csv.DictReader(path.open())}


def main() -> int:
    out = Path(sys.argv[1])
    ref = read(out / "fp32-standard.csv")
    failed = False
    for precision in ("bf16", "mixed"):
        std, sbp = read(out / f"{precision}-standard.csv"), read(out / f"{precision}-streambp.csv")
        worst, worst_step, envelope = 0.0, None, 0.0
        for step, r in sorted(ref.items()):
            L, N = float(r["loss"]), int(r["tokens"])
            envelope = max(envelope, abs(float(std[step]["loss"]) - L))
            d_std = envelope
            d_sbp = abs(float(sbp[step]["loss"]) - L)
            ratio = d_sbp / (FACTOR * d_std + U * L / math.sqrt(N))
            if ratio > worst:
                worst, worst_step = ratio, step
        last = max(ref)
        print(f"{precision}: worst step {worst_step}: ratio {worst:.3f} of the allowance (<= 1 passes); final loss "
              f"fp32 {float(ref[last]['loss']):.5f}, standard {float(std[last]['loss']):.5f}, "
              f"StreamBP {float(sbp[last]['loss']):.5f}")
        failed |= worst > 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
