#!/usr/bin/env bash
# The CPU tier's cost in a training step: qwen3-small, T = 1024, fp32, StreamBP, 4 AdamW steps, without offload and
# with everything offloaded (checkpoints, gradients, optimizer states, parameters), alternating, two rounds.
# From this folder: STREAMBP=<build>/streambp bash run.sh; then python3 summary.py
set -euo pipefail
cd "$(dirname "$0")"
STREAMBP=${STREAMBP:-../../../build/streambp}
common=(train --preset qwen3-small --seq 1024 --method streambp --steps 4 --optimizer adamw:lr=1e-5 --threads 2)
for round in r1 r2; do
  "$STREAMBP" "${common[@]}" --json "$round-plain.json" --metrics "$round-plain.csv" --force >"$round-plain.log" 2>&1
  "$STREAMBP" "${common[@]}" --offload checkpoints,grads,optimizer,params --offload-dir . --json "$round-offload.json" --metrics "$round-offload.csv" \
    --force >"$round-offload.log" 2>&1
done
lscpu | grep -E "^(Model name|Flags)" > lscpu.txt
