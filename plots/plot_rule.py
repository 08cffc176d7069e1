"""The low-precision rule beside the measured distribution of its statistics (issue #28): for every tensor of a
precision grid (results/rule/<run>/grid-*.csv, experiments/precision_grid/), the ratio of an exact method's l2 error
beside the run's common scale to standard BP's in the same dtype against the tensor's effective entry count, and the
rule's allowance curve noise_scale x sqrt(F quantile(n, n; 1 - 1e-6)) per precision as recorded in the rows; right: both
statistics (each tensor's, and each case's common scale) per precision, whose every value must stay below 1 (and, for a
margin, below 0.8).

Usage: python plots/plot_rule.py RUN_DIR   (writes RUN_DIR/rule.png)
"""
import csv
import gzip
import sys
from pathlib import Path

import matplotlib

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments" / "precision_grid"))
from summarize import NOISE_SCALE, rejudge  # noqa: E402  (the statistics under the rule's current noise scales)

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    run = Path(sys.argv[1])
    rows = [r for f in sorted(run.glob("grid-*.csv*")) if f.suffix in (".csv", ".gz")
            for r in csv.DictReader(gzip.open(f, "rt") if f.suffix == ".gz" else f.open())]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"fp32": "tab:blue", "bf16": "tab:red", "bf16-mixed": "tab:green"}
    for precision, color in colors.items():
        rs = [r for r in rows if r["precision"] == precision and float(r["standard_l2_beside_scale"]) > 0]
        n = [float(r["effective_entries"]) for r in rs]
        ratio = [float(r["method_l2_beside_scale"]) / float(r["standard_l2_beside_scale"]) for r in rs]
        left.scatter(n, ratio, s=3, alpha=0.25, color=color, label=f"{precision} ({len(rs)} tensors)")
        for r in rs:
            rejudge(r)
        curve = {float(r["effective_entries"]): r["_allowance"] for r in rs}
        xs = sorted(curve)
        left.plot(xs, [curve[x] for x in xs], color=color, lw=1.5, label=f"{precision} allowance")
        stats = sorted(r["_tensor"] for r in rs)
        right.hist(stats, bins=80, histtype="step", color=color, label=f"{precision} tensors: max {stats[-1]:.2f}" if stats else precision)
        cases = {(r["cpu_config"], r["model"], r["objective"], r["lora"], r["seed"], r["method"]): r["_scale"] for r in rs}
        scales = sorted(cases.values())
        if scales:
            right.hist(scales, bins=40, histtype="step", ls="--", color=color,
                       label=f"{precision} common scale: max {scales[-1]:.2f}")
    left.axhline(1.5, color="gray", ls=":", lw=1, label="former fixed 1.5x")
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("effective entries of the tensor, (sum a^2)^2 / sum a^4")
    left.set_ylabel("l2 error beside the common scale: exact method / standard BP")
    left.legend(fontsize=7, markerscale=3)
    right.axvline(1.0, color="black", lw=1.5, label="fails above 1")
    right.axvline(0.8, color="gray", ls=":", lw=1, label="margin 0.8")
    right.set_yscale("log")
    right.set_xlabel("statistic: error / (allowance x standard + floor)")
    right.set_ylabel("judgements")
    right.legend(fontsize=7)
    configs = sorted({r["cpu_config"] for r in rows})
    fig.suptitle(f"{len(rows)} tensor judgements over {len(configs)} CPU configurations; noise scales {NOISE_SCALE}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(run / "rule.png", dpi=120)
    print(run / "rule.png")


if __name__ == "__main__":
    main()
