#!/usr/bin/env python3
"""The bf16 table as markdown from bf16_table.sh outputs: before.txt [after.txt].

One row per (ISA, model, full/LoRA, bf16/mixed, method); per chunk count the worst per-tensor ratio of StreamBP's
l2 error to standard-bf16's (non-degenerate tensors), and the worst tensor at 512 chunks. With two files, each cell is
before -> after. Also prints each file's worst low-precision rule statistic (rule=, <= 1 passes; tables made before
the rule of issue #28 have rule_old/rule_new, the 1.5x allowance under the former floor u and the new one).
"""
import re
import sys


def parse(path):
    rows = {}
    for line in open(path):
        if not line.startswith("RESULT"):
            continue
        f = dict(re.findall(r"(\w+(?:\.\d)?)=(\S+)", line))
        m = re.search(r"layer_chunk=(\d+)", f["spec"])
        method = f"chunks={512 // int(m.group(1))}" if m else f["spec"]
        key = (f["isa"], f["model"], "LoRA" if f["lora"] != "-" else "full", "mixed" if f["mixed"] == "1" else "bf16")
        rows.setdefault(key, {})[method] = f
    return rows


def short(tensor):
    return tensor.replace("base_model.model.", "").replace("model.layers.", "L").replace(".weight", "")


files = [parse(p) for p in sys.argv[1:]]
chunk_cols = ["chunks=1", "chunks=8", "chunks=64", "chunks=512"]
other_cols = [c for c in next(iter(files[0].values())) if c not in chunk_cols]
print("| ISA | model | train | dtype | " + " | ".join(c.replace("chunks=", "") + " chunks" for c in chunk_cols)
      + " | worst tensor (64 chunks) | " + " | ".join(other_cols) + " |")
print("|" + "---|" * (5 + len(chunk_cols) + len(other_cols)))
for key in files[0]:
    cells = []
    for c in chunk_cols + other_cols:
        vals = [f"{float(fl[key][c]['worst_ratio']):.2f}" for fl in files]
        cells.append(" → ".join(vals))
    worst = " → ".join(short(fl[key]["chunks=64"]["tensor"]) for fl in files)
    chunk_part, other_part = cells[: len(chunk_cols)], cells[len(chunk_cols):]
    print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(chunk_part) + f" | {worst} | "
          + " | ".join(other_part) + " |")
for path, fl in zip(sys.argv[1:], files):
    for rule in ("rule", "rule_old", "rule_new"):
        if rule not in next(iter(next(iter(fl.values())).values())):
            continue
        worst = max((float(f[rule]), k, c) for k, row in fl.items() for c, f in row.items())
        print(f"\n{path}: largest {rule} (the rule's statistic, <= 1 passes) = {worst[0]:.3f} at {worst[1]} {worst[2]}")
