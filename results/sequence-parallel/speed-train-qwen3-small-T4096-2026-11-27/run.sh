#!/usr/bin/env bash
# StreamBP training steps on qwen3-small (fp32, SFT, AdamW, B = 1, T = 4096): one process (2 intra-op threads) against
# 2 ranks with the sequence split over them (--nproc 2 --sp 2, one thread each, Gloo), alternating twice. Time on this
# CPU is only a ratio in the same run: 2 ranks sharing 2 cores over Gloo is no speed reference for GPUs.
# Run from the repository root after `make build`: bash results/sequence-parallel/speed-train-qwen3-small-T4096-*/run.sh
set -euo pipefail
cd "$(dirname "$0")"
S=../../../build/streambp
common=(--preset qwen3-small --method streambp --batch 1 --seq 4096 --steps 3 --optimizer adamw:lr=1e-5 --seed 3)
for round in 1 2; do
  "$S" train "${common[@]}" --threads 2 --metrics one-$round.csv --force 2>one-$round.log
  "$S" train "${common[@]}" --nproc 2 --sp 2 --metrics sp-$round.csv --force 2>sp-$round.log
done
python3 - <<'PY'
import csv
for r in (1, 2):
    one, sp = ([row for row in csv.DictReader(open(f"{k}-{r}.csv"))][1:] for k in ("one", "sp"))
    bp1, bp2 = (sum(float(x["bp_seconds"]) for x in rows) / len(rows) for rows in (one, sp))
    pk1, pk2 = (max(int(x["peak_bytes"]) for x in rows) for rows in (one, sp))
    print(f"round {r}: BP {bp1:.2f} s one process, {bp2:.2f} s per rank of 2 ({bp2 / bp1:.2f}x); "
          f"peak {pk1 / 2**20:.0f} MiB, {pk2 / 2**20:.0f} MiB per rank ({pk2 / pk1:.2f}x); losses "
          f"{[x['loss'][:10] for x in one]} / {[x['loss'][:10] for x in sp]}")
PY
