#!/usr/bin/env python3
"""StreamBP in bf16 against StreamBP in fp32 and checkpointing in bf16 (issue #18 item 4), in one run.

The runs of every configuration alternate round by round (a shared machine's speed drifts over minutes; alternating
spreads the drift over all of them alike), each one `streambp run --json`, kept under OUT/. The summary prints and
writes OUT/summary.json: per configuration the median BP seconds and the medians of its phases, and the ratios that
issue #18 asks for. The machine, its ISA flags and the commit are in every run's provenance.

    experiments/bf16_speed/paired_runs.py build/streambp --preset qwen3-small --seq 4096 --rounds 3 --out DIR
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

CONFIGS = [  # (name, method, dtype)
    ("streambp-bf16", "streambp", "bf16"),
    ("streambp-fp32", "streambp", "fp32"),
    ("checkpoint-bf16", "checkpoint", "bf16"),
    ("checkpoint-fp32", "checkpoint", "fp32"),
]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("binary")
    p.add_argument("--preset", default="qwen3-small")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if os.path.exists(a.out):
        sys.exit(f"error: --out {a.out} exists; results are never overwritten")
    os.makedirs(a.out)
    runs = {name: [] for name, _, _ in CONFIGS}
    for r in range(a.rounds):
        for name, method, dtype in CONFIGS:
            out = os.path.join(a.out, f"{name}-{r}.json")
            cmd = [a.binary, "run", "--preset", a.preset, "--method", method, "--dtype", dtype, "--seq", str(a.seq),
                   "--threads", str(a.threads), "--json", out]
            print(f"[round {r + 1}/{a.rounds}] {name}", file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            with open(out) as f:
                runs[name].append(json.load(f))
    summary = {"command": " ".join(sys.argv), "configs": {}}
    for name, records in runs.items():
        phases = {}
        for rec in records:
            for ph in rec["phases"]:
                phases.setdefault(ph["name"], []).append(ph["seconds"])
        summary["configs"][name] = {
            "bp_seconds": statistics.median(rec["bp_seconds"] for rec in records),
            "bp_seconds_all": [rec["bp_seconds"] for rec in records],
            "phases_seconds": {k: statistics.median(v) for k, v in phases.items()},
            "peak_bytes": records[0]["peak_bytes"],
            "machine": records[0]["provenance"]["machine"],
            "commit": records[0]["provenance"]["commit"],
        }
    c = summary["configs"]
    s = lambda n: c[n]["bp_seconds"]
    summary["ratios"] = {
        "streambp_bf16_over_fp32": s("streambp-bf16") / s("streambp-fp32"),
        "streambp_bf16_over_checkpoint_bf16": s("streambp-bf16") / s("checkpoint-bf16"),
        "checkpoint_bf16_over_fp32": s("checkpoint-bf16") / s("checkpoint-fp32"),
    }
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"machine: {c['streambp-bf16']['machine']}")
    print(f"{'config':<17} {'BP s':>8}  phases (median s)")
    for name in runs:
        ph = ", ".join(f"{k} {v:.2f}" for k, v in c[name]["phases_seconds"].items())
        print(f"{name:<17} {s(name):8.2f}  {ph}")
    for k, v in summary["ratios"].items():
        print(f"{k}: {v:.3f}")


if __name__ == "__main__":
    main()
