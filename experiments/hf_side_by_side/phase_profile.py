#!/usr/bin/env python3
"""Where a StreamBP step's time goes, per dtype, beside this machine's GEMM rate (the ceiling).

For each dtype: `streambp run --json` (the step's time and its phases, each with its modelled FLOPs), the same with
`--op-profile` (its outermost ops, shares of the summed BP time of the measured steps: the profile's callbacks slow
the step, by 1.4-1.5x in bf16 at T = 8192 on 2026-12-04, so no time or rate is read from that run) and `streambp sweep
seq --check-seq 0` at the same point (the step's matrix-product FLOPs and a dense 2048^3 GEMM's rate in that dtype,
same threads). Writes OUT/summary.md, OUT/summary.json and every raw
file beside them, with the command that made them.

    experiments/hf_side_by_side/phase_profile.py build/streambp --preset qwen3-small --seq 4096 --out results/...
"""
import argparse
import csv
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

# Outermost ops (the op profile counts an op only where no other op encloses it) grouped by what they compute.
GROUPS = [
    ("attention (flash forward, chunk backward)", ("scaled_dot_product", "PrefixAndDiagonal")),
    ("matrix products (mm, linear, addmm, their backward)", ("aten::mm", "aten::linear", "aten::addmm", "MmBackward",
                                                             "AddmmBackward", "aten::matmul", "aten::bmm")),
    ("copies and casts", ("aten::copy_", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous")),
]


def group_of(name):
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "element-wise and the rest"


def run(cmd, log):
    print("+", " ".join(cmd), flush=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"phase_profile: {' '.join(cmd)} exited {rc}; see {log}")


def cpu_flags():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("binary")
    p.add_argument("--preset", default="qwen3-small")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    out = Path(a.out)
    if out.exists() and any(out.iterdir()):
        sys.exit(f"phase_profile: --out {out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    point = ["--preset", a.preset, "--seq", str(a.seq), "--threads", str(a.threads)]
    rows = {}
    for dtype in a.dtypes.split(","):
        ops_csv, record, profiled = out / f"ops-{dtype}.csv", out / f"run-{dtype}.json", out / f"ops-run-{dtype}.json"
        run([a.binary, "run", *point, "--method", "streambp", "--dtype", dtype, "--repeats", str(a.repeats),
             "--json", str(record)], out / f"run-{dtype}.log")
        run([a.binary, "run", *point, "--method", "streambp", "--dtype", dtype, "--repeats", str(a.repeats),
             "--op-profile", str(ops_csv), "--json", str(profiled)], out / f"ops-run-{dtype}.log")
        run([a.binary, "sweep", "seq", *point, "--methods", "streambp", "--dtype", dtype, "--repeats", "1",
             "--check-seq", "0", "--out", str(out / f"sweep-{dtype}")], out / f"sweep-{dtype}.log")
        rec, rec_profiled = json.loads(record.read_text()), json.loads(profiled.read_text())
        sweep = next(csv.DictReader(open(next((out / f"sweep-{dtype}").glob("*.csv")))))
        total = sum(rec_profiled["bp_seconds_all"])  # the op profile covers every measured step
        step = rec["bp_seconds"]
        phases = {ph["name"]: ph["seconds"] for ph in rec["phases"]}
        phase_flops = {ph["name"]: ph["flops"] for ph in rec["phases"] if ph.get("flops")}
        phase_sum = sum(phases.values())
        groups = {}
        for op in csv.DictReader(open(ops_csv)):
            g = group_of(op["name"])
            groups[g] = groups.get(g, 0.0) + float(op["seconds"])
        flops, gemm_rate = float(sweep["flops"]), float(sweep["gemm_flops_per_second"])
        rows[dtype] = {
            "bp_seconds": step,
            "phases_seconds": phases,
            "phase_shares": {k: v / phase_sum for k, v in phases.items()},
            "op_group_shares": {k: v / total for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
            "flops": flops,
            "gemm_flops_per_second": gemm_rate,
            "ceiling_seconds": flops / gemm_rate,
            "achieved_share_of_gemm_rate": (flops / step) / gemm_rate,
            # Each phase's modelled FLOPs (the binary's flop model) over its seconds in the run without the op profile.
            "phase_flops": phase_flops,
            "phase_achieved_share_of_gemm_rate": {k: f / phases[k] / gemm_rate for k, f in phase_flops.items()
                                                  if phases.get(k)},
            "sweep_bp_seconds": float(sweep["bp_seconds"]),
            "op_profiled_bp_seconds": rec_profiled["bp_seconds"],
            "gemm_paths": next((line.split("bf16 GEMMs", 1)[1].strip() for line in
                                open(out / f"run-{dtype}.log") if "bf16 GEMMs" in line), ""),
        }
    summary = {
        "command": " ".join([sys.argv[0], *sys.argv[1:]]),
        "provenance": {"commit": git_commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "host": platform.node(), "cpu_flags": cpu_flags(), "cpus": os.cpu_count(),
                       "threads": a.threads, "preset": a.preset, "seq": a.seq, "method": "streambp"},
        "dtypes": rows,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    md = [f"# Where a StreamBP step's time goes: {a.preset}, T = {a.seq}, {a.threads} threads", "",
          f"Made by `{summary['command']}` at commit {summary['provenance']['commit'][:12]}, "
          f"{summary['provenance']['date'][:19]}Z. Raw files beside this one.", "",
          "| | " + " | ".join(rows) + " |", "|---|" + "---|" * len(rows)]
    md.append("| BP s (median) | " + " | ".join(f"{r['bp_seconds']:.2f}" for r in rows.values()) + " |")
    md.append("| BP s under the op profile (its ops' run) | " + " | ".join(
        f"{r['op_profiled_bp_seconds']:.2f}" for r in rows.values()) + " |")
    for ph in next(iter(rows.values()))["phases_seconds"]:
        md.append(f"| phase {ph} | " + " | ".join(
            f"{r['phases_seconds'].get(ph, 0):.2f} s ({r['phase_shares'].get(ph, 0):.1%})"
            + (f", {r['phase_achieved_share_of_gemm_rate'][ph]:.0%} of the GEMM rate"
               if ph in r["phase_achieved_share_of_gemm_rate"] else "")
            for r in rows.values()) + " |")
    groups = sorted({g for r in rows.values() for g in r["op_group_shares"]})
    for g in groups:
        md.append(f"| ops: {g} | " + " | ".join(f"{r['op_group_shares'].get(g, 0):.1%}" for r in rows.values()) + " |")
    md.append("| GEMM rate (2048^3), GFLOP/s | " + " | ".join(f"{r['gemm_flops_per_second'] / 1e9:.0f}"
                                                         for r in rows.values()) + " |")
    md.append("| step's matrix FLOPs at that rate, s (the ceiling) | " + " | ".join(
        f"{r['ceiling_seconds']:.2f}" for r in rows.values()) + " |")
    md.append("| achieved share of the GEMM rate | " + " | ".join(
        f"{r['achieved_share_of_gemm_rate']:.0%}" for r in rows.values()) + " |")
    md.append("| bf16 GEMM paths | " + " | ".join(r["gemm_paths"] or "-" for r in rows.values()) + " |")
    md += ["", "Phase shares are of the phases' summed time; a phase's share of the GEMM rate is its modelled "
           "matrix-product FLOPs (core/methods/flop_model.h) over its seconds; both from the run without the op "
           "profile; op shares of the measured steps' summed BP time (the op "
           "profile counts outermost ops only, so a backward node's time includes the products inside it).", ""]
    (out / "summary.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
