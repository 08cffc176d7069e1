#!/usr/bin/env bash
# The bf16 table of issue #18 item 3: StreamBP's worst per-tensor l2 error ratio to standard BP in bf16, at 1, 8, 64
# and 512 layer/head chunks (T = 512), on the 4-layer d = 128 model (d128/config.json) and on `tiny`, full and LoRA,
# bf16 and bf16-mixed, under the native ISA and under ONEDNN_MAX_CPU_ISA=AVX512_CORE (oneDNN's emulated bf16).
#   bf16_table.sh BUILD_DIR OUT_FILE [extra specs...]
# BUILD_DIR's streambp_bf16_table (built with the rest: make build), one line per run: the worst ratio and the
# low-precision rule's verdict (bf16_markdown.py makes the table). Tables of older commits (results/bf16/) came from
# that commit's copy of this script.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "$1" && pwd)
out=$2
shift 2
bin=$build/streambp_bf16_table
[[ -x $bin ]] || { echo "bf16_table.sh: no $bin (make build)" >&2; exit 2; }
specs=()
for n in 1 8 64 512; do c=$((512 / n)); specs+=("streambp:layer_chunk=$c,head_chunk=$c"); done
specs+=("$@")
: > "$out"
for isa in native AVX512_CORE; do
  for model in "$here/d128/config.json" tiny; do
    for lora in - rank=8,init=random; do
      for mixed in 0 1; do
        if [[ $isa == native ]]; then env_isa=(); else env_isa=(ONEDNN_MAX_CPU_ISA=$isa); fi
        env "${env_isa[@]}" OMP_NUM_THREADS=1 "$bin" "$model" "$lora" "$mixed" "${specs[@]}" | sed "s/^RESULT /RESULT isa=$isa /" >> "$out"
      done
    done
  done
done
