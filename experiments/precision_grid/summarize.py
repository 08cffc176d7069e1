#!/usr/bin/env python3
"""Summary of a precision grid (experiments/precision_grid/precision_grid.sh OUT_DIR): per CPU configuration,
precision and method, how many tensors were judged, how many the rule failed (statistic > 1: every one is a false
failure, the methods are exact), and the worst statistic with its tensor; then the ratio method/standard l2 error by
effective entry count beside the allowance, the data behind the rule.

    python experiments/precision_grid/summarize.py OUT_DIR     (writes OUT_DIR/summary.csv, prints markdown)
"""
import csv
import gzip
import math
import sys
from collections import defaultdict
from pathlib import Path


def method_family(spec):
    name = spec.split(":")[0]
    if name == "streambp":
        layer_chunk = int(spec.split("layer_chunk=")[1].split(",")[0])
        return f"streambp (layer_chunk={layer_chunk})"
    return spec


def main():
    out = Path(sys.argv[1])
    rows = []
    for f in sorted(out.glob("grid-*.csv*")):
        if f.suffix in (".csv", ".gz"):
            rows += list(csv.DictReader(gzip.open(f, "rt") if f.suffix == ".gz" else f.open()))
    if not rows:
        sys.exit(f"error: no grid-*.csv in {out}")
    groups = defaultdict(list)
    for r in rows:
        groups[(r["cpu_config"], r["precision"], r["model"], method_family(r["method"]))].append(r)
    table = []
    for (cpu, precision, model, method), rs in sorted(groups.items()):
        worst = max(rs, key=lambda r: float(r["statistic"]))
        table.append({"cpu_config": cpu, "precision": precision, "model": model, "method": method, "tensors": len(rs),
                      "false_failures": sum(float(r["statistic"]) > 1 for r in rs),
                      "worst_statistic": worst["statistic"], "worst_ratio": f"{float(worst['method_l2']) / float(worst['standard_l2']):.4f}"
                      if float(worst["standard_l2"]) > 0 else "", "worst_tensor": worst["tensor"],
                      "worst_effective_entries": worst["effective_entries"], "worst_case":
                      f"{worst['objective']} {worst['lora']} seed {worst['seed']}"})
    with (out / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    stats = [float(r["statistic"]) for r in rows]
    worst = max(rows, key=lambda r: float(r["statistic"]))
    print(f"{len(rows)} tensor judgements, {len({r['cpu_config'] for r in rows})} CPU configurations; "
          f"false failures: {sum(s > 1 for s in stats)}; worst statistic {max(stats):.3f} ({worst['cpu_config']}, "
          f"{worst['model']} {worst['precision']} {worst['method']} {worst['tensor']}, n_eff {worst['effective_entries']})\n")
    print("| precision | method | tensors | false failures | worst statistic | its tensor (n_eff) |")
    print("|---|---|---|---|---|---|")
    by_pm = defaultdict(list)
    for r in rows:
        by_pm[(r["precision"], method_family(r["method"]))].append(r)
    for (precision, method), rs in sorted(by_pm.items()):
        w = max(rs, key=lambda r: float(r["statistic"]))
        print(f"| {precision} | {method} | {len(rs)} | {sum(float(r['statistic']) > 1 for r in rs)} | "
              f"{float(w['statistic']):.3f} | {w['tensor']} ({float(w['effective_entries']):.0f}, {w['cpu_config']}) |")
    print("\nThe ratio method/standard l2 error by effective entry count (all configurations and methods):\n")
    print("| n_eff | tensors | median ratio | 99.9th percentile | max ratio | allowance (1.5 x quantile) | worst statistic |")
    print("|---|---|---|---|---|---|---|")
    buckets = defaultdict(list)
    for r in rows:
        if float(r["standard_l2"]) > 0:
            n = float(r["effective_entries"])
            buckets[int(math.log2(max(n, 1)))].append(r)
    for b, rs in sorted(buckets.items()):
        ratios = sorted(float(r["method_l2"]) / float(r["standard_l2"]) for r in rs)
        p999 = ratios[min(len(ratios) - 1, int(0.999 * len(ratios)))]
        allow = min(float(r["allowance"]) for r in rs)
        print(f"| {2 ** b}-{2 ** (b + 1) - 1} | {len(rs)} | {ratios[len(ratios) // 2]:.3f} | {p999:.3f} | {ratios[-1]:.3f} | "
              f">= {allow:.2f} | {max(float(r['statistic']) for r in rs):.3f} |")


if __name__ == "__main__":
    main()
