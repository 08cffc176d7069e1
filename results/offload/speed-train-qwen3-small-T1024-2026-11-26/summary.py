# The table of README.md from the runs' per-step CSVs (steps 2-4: the first allocates everything once).
import csv, glob, json, statistics

rows = {}
for f in sorted(glob.glob("r*-*.csv")):
    steps = [r for r in csv.DictReader(l for l in open(f) if not l.startswith("#"))][1:]
    record = json.load(open(f.replace(".csv", ".json")))
    rows[f[:-4]] = (statistics.mean(float(s["bp_seconds"]) for s in steps),
                    statistics.mean(float(s["optimizer_seconds"]) for s in steps),
                    record["peak_bytes"], record["host_peak_bytes"])
print("| run | BP s | optimizer s | device peak (MiB) | tier (MiB) |\n|---|---|---|---|---|")
for name, (bp, opt, peak, host) in rows.items():
    print(f"| {name} | {bp:.2f} | {opt:.3f} | {peak / 2**20:.1f} | {host / 2**20 if host else 0:.1f} |")
for r in ("r1", "r2"):
    p, o = rows[f"{r}-plain"], rows[f"{r}-offload"]
    print(f"{r}: offload / plain: BP {o[0] / p[0]:.3f}, optimizer {o[1] / p[1]:.3f}")
