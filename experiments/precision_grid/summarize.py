#!/usr/bin/env python3
"""Summary of a precision grid (experiments/precision_grid/precision_grid.sh OUT_DIR): per CPU configuration,
precision and method, how many tensors were judged, how many the rule failed (statistic > 1: every one is a false
failure, the methods are exact), and the worst statistic of the rule's two parts (verify/grad_compare.h: each tensor's
error beside the run's common scale, and that scale) with its tensor; then the ratio method/standard l2 error beside
the common scale by effective entry count beside the allowance, and the common scale against standard's run error:
the data behind the rule.

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


# The rule's noise scale per precision (verify/grad_compare.cpp low_precision_noise_scale) and the Gaussian quantile of
# its common-scale part: the statistics are recomputed from the recorded errors under these, so that a grid made
# under an earlier noise scale is judged by the rule as it stands (the recorded scale is scale_allowance / z).
NOISE_SCALE = {"fp32": 3.0, "bf16": 2.5, "bf16-mixed": 2.5}
GAUSSIAN_Z = 4.891638


def rejudge(r):
    """The row's two statistics under NOISE_SCALE, from its recorded errors, allowance and floors."""
    if "_tensor" not in r:
        recorded = float(r["scale_allowance"]) / GAUSSIAN_Z
        factor = NOISE_SCALE[r["precision"]] / recorded
        standard = float(r["standard_l2_beside_scale"])
        denominator = float(r["allowance"]) * factor * standard + float(r["floor"])
        r["_tensor"] = float(r["method_l2_beside_scale"]) / denominator if denominator > 0 else float(r["statistic"])
        method_scale, old = float(r["method_scale"]), float(r["scale_statistic"])
        if old > 0:
            scale_denominator = method_scale / old + (factor - 1) * recorded * GAUSSIAN_Z * float(r["standard_run_error"])
            r["_scale"] = method_scale / scale_denominator
        else:
            r["_scale"] = 0.0
        r["_allowance"] = float(r["allowance"]) * factor
    return r["_tensor"], r["_scale"]


# The recorded numbers a statistic is made of.
RECORDED = ("statistic", "scale_statistic", "method_l2_beside_scale", "standard_l2_beside_scale", "allowance", "floor",
            "method_scale", "standard_run_error", "scale_allowance")


def statistic(r):
    """The row's worst judgement: its tensor's, or its case's common scale (one value repeated on every row). A row
    with a number that is not finite is +inf, a failure: a NaN compares false with the bar, and an Inf in standard's
    error made the recomputed statistic 0 (issue #44)."""
    if not all(math.isfinite(float(r[k])) for k in RECORDED):
        return math.inf
    return max(x if math.isfinite(x) else math.inf for x in rejudge(r))


def judged(r):
    """Which judgement is the worst: the tensor, or the case's common scale."""
    tensor, scale = rejudge(r)
    return r["tensor"] if tensor >= scale else "(common scale)"


def conform_summary(out):
    """The HF adapters through conform (conform_grid.sh): per dtype, cases, failures and the worst statistic."""
    rows = [r for f in sorted(out.glob("conform-*/conform-*.csv")) for r in csv.DictReader(f.open())]
    if not rows:
        return
    print(f"HF gradient checkpointing through `streambp conform`, HF standard BP as the baseline "
          f"({len(rows)} cases, conform_grid.sh):\n")
    print("| dtype | cases | failures | worst statistic | its case and tensor |")
    print("|---|---|---|---|---|")
    for dtype in sorted({r["dtype"] for r in rows}):
        rs = [r for r in rows if r["dtype"] == dtype]
        w = max(rs, key=lambda r: float(r["worst"] or "inf"))
        print(f"| {dtype} | {len(rs)} | {sum(r['status'] != 'passed' for r in rs)} | {float(w['worst'] or 'inf'):.3f} | "
              f"{w['case']} {w['worst_tensor']} |")
    print()


def main():
    out = Path(sys.argv[1])
    conform_summary(out)
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
        worst = max(rs, key=statistic)
        table.append({"cpu_config": cpu, "precision": precision, "model": model, "method": method, "tensors": len(rs),
                      "false_failures": sum(statistic(r) > 1 for r in rs),
                      "worst_statistic": f"{statistic(worst):.4f}", "worst_tensor": judged(worst),
                      "worst_effective_entries": worst["effective_entries"], "worst_case":
                      f"{worst['objective']} {worst['lora']} seed {worst['seed']}"})
    with (out / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    stats = [statistic(r) for r in rows]
    worst = max(rows, key=statistic)
    cases = {(r["cpu_config"], r["model"], r["objective"], r["lora"], r["precision"], r["seed"], r["method"]): r for r in rows}
    print(f"Statistics under the rule's noise scales {NOISE_SCALE} (recomputed from the recorded errors).\n")
    print(f"{len(rows)} tensor judgements and {len(cases)} common-scale judgements, "
          f"{len({r['cpu_config'] for r in rows})} CPU configurations; "
          f"false failures: {sum(s > 1 for s in stats)}; worst statistic {max(stats):.3f} ({worst['cpu_config']}, "
          f"{worst['model']} {worst['objective']} {worst['lora']} seed {worst['seed']} {worst['precision']} "
          f"{worst['method']} {judged(worst)}, n_eff {worst['effective_entries']})\n")
    print("| precision | method | tensors | false failures | worst statistic | its tensor (n_eff) |")
    print("|---|---|---|---|---|---|")
    by_pm = defaultdict(list)
    for r in rows:
        by_pm[(r["precision"], method_family(r["method"]))].append(r)
    for (precision, method), rs in sorted(by_pm.items()):
        w = max(rs, key=statistic)
        print(f"| {precision} | {method} | {len(rs)} | {sum(statistic(r) > 1 for r in rs)} | "
              f"{statistic(w):.3f} | {judged(w)} ({float(w['effective_entries']):.0f}, {w['objective']} {w['lora']}, "
              f"{w['cpu_config']}) |")
    print("\nThe common scale |r| of every case against standard's whole-run error E_s, per precision and objective:\n")
    print("| precision | objective | cases | median |r| / E_s | max |r| / E_s | allowance | worst scale statistic |")
    print("|---|---|---|---|---|---|---|")
    by_po = defaultdict(list)
    for r in cases.values():
        by_po[(r["precision"], r["objective"])].append(r)
    for (precision, objective), rs in sorted(by_po.items()):
        q = sorted(float(r["method_scale"]) / float(r["standard_run_error"]) for r in rs if float(r["standard_run_error"]) > 0)
        print(f"| {precision} | {objective} | {len(rs)} | {q[len(q) // 2]:.3f} | {q[-1]:.3f} | "
              f"{NOISE_SCALE[precision] * GAUSSIAN_Z:.2f} | {max(rejudge(r)[1] for r in rs):.3f} |")
    print("\nThe ratio method/standard l2 error beside the common scale, by effective entry count (all configurations "
          "and methods):\n")
    print("| n_eff | tensors | median ratio | 99.9th percentile | max ratio | smallest allowance (bf16) | worst statistic |")
    print("|---|---|---|---|---|---|---|")
    buckets = defaultdict(list)
    for r in rows:
        if float(r["standard_l2_beside_scale"]) > 0:
            n = float(r["effective_entries"])
            buckets[int(math.log2(max(n, 1)))].append(r)
    for b, rs in sorted(buckets.items()):
        ratios = sorted(float(r["method_l2_beside_scale"]) / float(r["standard_l2_beside_scale"]) for r in rs)
        p999 = ratios[min(len(ratios) - 1, int(0.999 * len(ratios)))]
        allow = min(rejudge(r) and r["_allowance"] for r in rs)
        print(f"| {2 ** b}-{2 ** (b + 1) - 1} | {len(rs)} | {ratios[len(ratios) // 2]:.3f} | {p999:.3f} | {ratios[-1]:.3f} | "
              f">= {allow:.2f} | {max(rejudge(r)[0] for r in rs):.3f} |")


if __name__ == "__main__":
    main()
