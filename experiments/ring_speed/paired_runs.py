#!/usr/bin/env python3
"""The ring's training step against the all-gather's on the CPU, as a ratio only (issue #48 item 5).

Per round and method, `train --nproc N --sp N` runs once with `--sp-scheme ring` and once with `allgather`, the order
swapped every round (ABBA: a shared machine's speed drifts over minutes; alternating gives both schemes the same
drift, which is what makes the ratio fair). A run's time is the median BP seconds of its steps after the first. Each
round gives ring / all-gather per method; the summary has their median, min and max, and the bytes per layer each
scheme hands its collectives (the metrics' sp_* counters, which equal sequence_step_collectives byte by byte).

    experiments/ring_speed/paired_runs.py build/streambp --preset qwen3-small --seq 2048 --rounds 3 --out DIR

OUT gets runs.csv (one row per run, with its provenance, load and status), summary.json, and every run's metrics
CSV, JSON sidecar and log; it is written as OUT.partial and renamed when complete (an earlier OUT is never
overwritten). Exit 1 if any run failed, 2 on bad arguments.
"""
import argparse
import csv
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

SCHEMES = ("ring", "allgather")
COLUMNS = ["round", "position", "method", "scheme", "status", "exit_code", "bp_seconds", "bp_seconds_steps", "loss",
           "sp_ring_shift_calls", "sp_ring_shift_bytes", "sp_all_gather_calls", "sp_all_gather_bytes",
           "sp_reduce_scatter_calls", "sp_reduce_scatter_bytes", "layers", "bytes_per_layer", "load_before",
           "load_after", "other_cores", "commit", "date", "machine", "threads", "torch_version", "preset", "dtype",
           "seed", "world_size", "seq", "batch", "command"]


def cpu_counters():
    """(wall, busy seconds of every CPU from /proc/stat, CPU seconds of this process's reaped children, load)."""
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    busy = (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / tick  # user nice system irq softirq
    t = os.times()
    return time.monotonic(), busy, t.children_user + t.children_system, os.getloadavg()[0]


def hops_per_layer(method, world):
    # The ring's hops per layer and micro-batch (ring_hops_per_layer): (forward passes + 1) x (N - 1) + N; standard
    # BP passes forward once, checkpointing and StreamBP twice (the backward's recompute).
    passes = 1 if method.split(":")[0] == "standard" else 2
    return (passes + 1) * (world - 1) + world


def lscpu_flags():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""
    return next((l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Flags:")), "")


def one_run(a, work, rnd, position, method, scheme):
    name = f"{method.split(':')[0]}-{scheme}-{rnd}"
    metrics = os.path.join(work, name + ".csv")
    cmd = [a.binary, "train", "--preset", a.preset, "--dtype", a.dtype, "--method", method, "--batch", str(a.batch),
           "--seq", str(a.seq), "--steps", str(a.steps), "--optimizer", "adamw:lr=1e-5", "--seed", str(a.seed),
           "--nproc", str(a.sp), "--sp", str(a.sp), "--sp-scheme", scheme, "--metrics", metrics]
    before = cpu_counters()
    with open(os.path.join(work, name + ".log"), "w") as log:
        code = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=log).returncode
    after = cpu_counters()
    row = {k: "" for k in COLUMNS}
    row.update(round=rnd, position=position, method=method, scheme=scheme, exit_code=code, preset=a.preset,
               dtype=a.dtype, seed=a.seed, world_size=a.sp, seq=a.seq, batch=a.batch, command=shlex.join(cmd),
               load_before=f"{before[3]:.2f}", load_after=f"{after[3]:.2f}",
               other_cores=f"{max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / (after[0] - before[0]):.2f}")
    steps = list(csv.DictReader(open(metrics))) if code == 0 and os.path.exists(metrics) else []
    if len(steps) != a.steps:
        row["status"] = "failed"
        return row
    with open(os.path.join(work, name + ".json")) as f:
        prov = json.load(f)["provenance"]
    row.update(commit=prov["commit"], date=prov["date"], machine=prov["machine"], threads=prov["threads"],
               torch_version=prov["torch_version"])
    timed = [float(s["bp_seconds"]) for s in steps[1:]]  # the first step warms the allocator and the GEMM choice
    row.update(bp_seconds=f"{statistics.median(timed):.4f}", bp_seconds_steps=";".join(f"{t:.4f}" for t in timed),
               loss=steps[-1]["loss"])
    last = steps[-1]
    for k in ("sp_ring_shift_calls", "sp_ring_shift_bytes", "sp_all_gather_calls", "sp_all_gather_bytes",
              "sp_reduce_scatter_calls", "sp_reduce_scatter_bytes"):
        row[k] = last.get(k, "")
    # The K/V traffic of one layer: the step's counts less the one 8-byte all-gather of the sequence length (the
    # group's check), over the layers, which the ring's hop count gives (every step counts the same).
    hops = int(last["sp_ring_shift_calls"] or 0)
    ring_run = scheme == "ring"
    layers = hops // hops_per_layer(method, a.sp) if ring_run else None
    if ring_run and (layers == 0 or hops % hops_per_layer(method, a.sp)):
        row["status"] = "incorrect"  # the hop count is not the formula's
        return row
    if layers:
        row.update(layers=layers, bytes_per_layer=int(last["sp_ring_shift_bytes"]) // layers)
    else:
        row["bytes_per_layer"] = ""  # filled from the ring's layer count below
    row["status"] = "passed"
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("binary")
    p.add_argument("--preset", default="qwen3-small")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--steps", type=int, default=3, help="training steps per run; the first is not timed")
    p.add_argument("--sp", type=int, default=2, help="ranks of the group (--nproc and --sp)")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--methods", default="streambp;checkpoint", help="';'-separated method specs")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.steps < 2 or a.rounds < 1 or a.sp < 2:
        p.error("--steps >= 2 (the first is not timed), --rounds >= 1 and --sp >= 2")
    if os.path.exists(a.out) or os.path.exists(a.out + ".partial"):
        p.error(f"--out {a.out} (or {a.out}.partial) exists; results are never overwritten")
    work = a.out + ".partial"
    os.makedirs(work)
    methods = a.methods.split(";")
    rows = []
    for rnd in range(1, a.rounds + 1):
        for method in methods:
            order = SCHEMES if rnd % 2 else SCHEMES[::-1]
            for position, scheme in enumerate(order, 1):
                print(f"[round {rnd}/{a.rounds}] {method} {scheme} (load {os.getloadavg()[0]:.2f})", file=sys.stderr,
                      flush=True)
                rows.append(one_run(a, work, rnd, position, method, scheme))
    # The all-gather's bytes per layer, over the ring's layer count (the same model).
    layers = next((r["layers"] for r in rows if r["layers"]), None)
    for r in rows:
        if r["scheme"] == "allgather" and r["status"] == "passed" and layers:
            r["layers"] = layers
            r["bytes_per_layer"] = (int(r["sp_all_gather_bytes"]) - 8 + int(r["sp_reduce_scatter_bytes"])) // layers
    with open(os.path.join(work, "runs.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    summary = {"command": shlex.join([sys.executable] + sys.argv), "lscpu_flags": lscpu_flags(), "methods": {}}
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        ratios = []
        for rnd in range(1, a.rounds + 1):
            pair = {r["scheme"]: r for r in mine if r["round"] == rnd and r["status"] == "passed"}
            if len(pair) == 2:
                ratios.append(float(pair["ring"]["bp_seconds"]) / float(pair["allgather"]["bp_seconds"]))
        per_layer = {s: next((r["bytes_per_layer"] for r in mine if r["scheme"] == s and r["bytes_per_layer"] != ""),
                             None) for s in SCHEMES}
        summary["methods"][method] = {
            "ring_over_allgather": {"median": statistics.median(ratios) if ratios else None,
                                    "min": min(ratios, default=None), "max": max(ratios, default=None),
                                    "per_round": ratios},
            "bytes_per_layer": per_layer, "layers": layers,
            "load_1min": [min(float(r["load_before"]) for r in mine), max(float(r["load_after"]) for r in mine)],
        }
    with open(os.path.join(work, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    os.rename(work, a.out)
    failed = [r for r in rows if r["status"] != "passed"]
    for method, s in summary["methods"].items():
        r = s["ring_over_allgather"]
        if r["median"] is not None:
            print(f"{method}: ring / all-gather BP time {r['median']:.3f} (min {r['min']:.3f}, max {r['max']:.3f}, "
                  f"{len(r['per_round'])} rounds); bytes per layer and rank: ring {s['bytes_per_layer']['ring']}, "
                  f"all-gather {s['bytes_per_layer']['allgather']}; load {s['load_1min'][0]:.1f}-{s['load_1min'][1]:.1f}")
    for r in failed:
        print(f"{r['status']}: {r['method']} {r['scheme']} round {r['round']} (exit {r['exit_code']}): {r['command']}",
              file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
