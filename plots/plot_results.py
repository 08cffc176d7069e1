"""Figures from results/ (read-only): peak memory and BP time ratio vs sequence length, one figure per demo CSV.

Usage: python plots/plot_results.py [results_dir]   (writes <csv stem>.png next to each CSV that has no figure yet)
"""
import csv
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_demo(csv_path: Path) -> Path:
    rows = list(csv.DictReader(csv_path.open()))
    # A time ratio exists only where the same run measured checkpointing at that T (files written before empty cells
    # were introduced hold 0 there instead: never plotted).
    timed_lengths = {r["seq_len"] for r in rows if r["method"] == "checkpoint"}
    by_method = defaultdict(list)
    for r in rows:
        by_method[r["method"]].append(r)
    fig, (mem, time) = plt.subplots(1, 2, figsize=(11, 4))
    for method, rs in by_method.items():
        rs.sort(key=lambda r: int(r["seq_len"]))
        T = [int(r["seq_len"]) for r in rs]
        line, = mem.plot(T, [int(r["peak_bytes"]) / 2**30 for r in rs], "o-", label=f"{method} (measured)")
        mem.plot(T, [int(r["model_peak_bytes"]) / 2**30 for r in rs], "--", color=line.get_color(), alpha=0.6)
        # An empty ratio means the run had no checkpoint row to divide by: no point, never an invented 0.
        timed = [(t, float(r["time_vs_checkpoint"])) for t, r in zip(T, rs)
                 if r.get("time_vs_checkpoint") and r["seq_len"] in timed_lengths]
        if timed:
            time.plot([t for t, _ in timed], [x for _, x in timed], "o-", label=method)
    first = rows[0]
    what = f"{first.get('objective', 'sft')}, B={first.get('batch_size', 1)}"
    if first.get("lora"):
        what += f", LoRA {first['lora']}"
    mem.set(xlabel="sequence length T", ylabel="peak memory (GiB); dashed: analytic model",
            title=f"{first['preset']} {first['dtype']}, {what}"[:90])
    time.set(xlabel="sequence length T", ylabel="BP time / checkpointing (same run)", title="BP time ratio")
    mem.legend(fontsize=7)
    if time.lines:
        time.legend(fontsize=7)
    else:
        time.text(0.5, 0.5, "no checkpoint row in this run:\nno time ratio", ha="center", va="center",
                  transform=time.transAxes)
    fig.suptitle(f"commit {first['commit']}, {first['date']}, {first['threads']} threads", fontsize=8)
    fig.tight_layout()
    out = csv_path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "results")
    for csv_path in sorted(root.glob("*/demo-*.csv")):
        if not csv_path.with_suffix(".png").exists():  # figures are derived; never redraw over an existing one
            print("wrote", plot_demo(csv_path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
