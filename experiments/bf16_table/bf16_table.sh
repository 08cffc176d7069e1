#!/usr/bin/env bash
# The bf16 table of issue #18 item 3: StreamBP's worst per-tensor l2 error ratio to standard BP in bf16, at 1, 8, 64
# and 512 layer/head chunks (T = 512), on the 4-layer d = 128 model (d128/config.json) and on `tiny`, full and LoRA,
# bf16 and bf16-mixed, under the native ISA and under ONEDNN_MAX_CPU_ISA=AVX512_CORE (oneDNN's emulated bf16).
#   [SRC=DIR] bf16_table.sh BUILD_DIR OUT_FILE [extra specs...]
# Builds bf16_table.cpp against BUILD_DIR's libraries and SRC's headers (default: this checkout). It uses only the
# public API, so any commit's build serves, with that commit's sources as SRC (the headers must match the
# libraries), e.g. for the table before issue #18's fix:
#   mkdir -p /tmp/before-src && git archive 1c55fce core verify baselines | tar -x -C /tmp/before-src
#   SRC=/tmp/before-src bf16_table.sh /tmp/before-build before.txt   (/tmp/before-build: that commit's build/)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=${SRC:-$here/../..}
build=$(cd "$1" && pwd)
out=$2
shift 2
torch=$(ls -d "$HOME"/.cache/streambp/venv-torch-*/lib/python3.11/site-packages/torch | head -1)
bin=$build/bf16_table
if [[ ! -x $bin || $here/bf16_table.cpp -nt $bin || $build/core/libstreambp_core.a -nt $bin || -n ${SRC:-} ]]; then
  c++ -O2 -std=c++20 -DFMT_HEADER_ONLY -I"$src" -isystem "$torch/include" \
    -isystem "$torch/include/torch/csrc/api/include" "$here/bf16_table.cpp" -o "$bin" \
    "$build/baselines/libstreambp_baselines.a" "$build/verify/libstreambp_verify.a" "$build/core/libstreambp_core.a" \
    -L"$torch/lib" -Wl,-rpath,"$torch/lib" -Wl,--no-as-needed -ltorch -ltorch_cpu -lc10
fi
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
