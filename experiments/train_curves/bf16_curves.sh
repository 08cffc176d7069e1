#!/usr/bin/env bash
# Issue #19's bf16 training curves: 50 AdamW steps on qwen3-small, the same 4 batches cycled (so the loss falls),
# StreamBP and standard BP in pure bf16 (bf16 weights and AdamW states) and in mixed precision (fp32 masters and
# states), against an fp32 standard run as the reference trajectory. Writes OUT/{fp32-standard,bf16-*,mixed-*}.csv
# (per-step metrics with JSON sidecars) and OUT/batches/; check_curves.py judges them and plots/ draws them.
# Usage: experiments/train_curves/bf16_curves.sh BUILD/streambp OUT [STEPS] [SEQ]
set -euo pipefail
bin=$1 out=$2 steps=${3:-50} seq=${4:-1024}
if [ -e "$out" ]; then echo "error: $out exists (results are never overwritten)" >&2; exit 1; fi
mkdir -p "$out/batches"
for s in 1 2 3 4; do
  "$bin" run --preset qwen3-small --method standard --dtype bf16 --seq "$seq" --seed "$s" --threads 2 \
    --save-batch "$out/batches/batch-$s.safetensors" > /dev/null
done
common=(--preset qwen3-small --data "$out/batches" --steps "$steps" --optimizer adamw:lr=1e-3,weight_decay=0.01
        --lr-schedule cosine,warmup=5 --clip-grad-norm 1.0 --seed 0 --threads 2)
"$bin" train "${common[@]}" --dtype fp32 --method standard --metrics "$out/fp32-standard.csv"
for m in standard streambp; do
  spec=$m; [ "$m" = streambp ] && spec="streambp:layer_chunk=256,head_chunk=256"
  "$bin" train "${common[@]}" --dtype bf16 --method "$spec" --metrics "$out/bf16-$m.csv"
  "$bin" train "${common[@]}" --dtype bf16 --grad-dtype fp32 --method "$spec" --metrics "$out/mixed-$m.csv"
done
