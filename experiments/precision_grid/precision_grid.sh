#!/usr/bin/env bash
# The low-precision rule's statistic over every CPU configuration this machine can reach (issue #28): the grid of
# streambp_precision_grid (seeds x models x objectives x full/LoRA x fp32/bf16/bf16-mixed x exact methods) once per
# configuration of the two knobs that choose kernels: ATEN_CPU_CAPABILITY (ATen's own vectorised kernels: norms,
# reductions, elementwise) and ONEDNN_MAX_CPU_ISA (oneDNN's GEMMs), and each bf16 GEMM path pinned
# (STREAMBP_NARROW_GEMM=native|widened, core/model/gemm.h): the rule must hold on both.
# Configurations the CPU cannot run are skipped (ATen clamps a capability to the CPU's own; oneDNN its ISA cap).
#   experiments/precision_grid/precision_grid.sh BUILD OUT_DIR [grid flags, e.g. --seeds 20]
# Writes OUT_DIR/grid-<config>.csv (+ .json provenance) per configuration, OUT_DIR/lscpu.txt, then the summary and the
# figure (plots/plot_precision.py). Configurations run two at a time, one thread each.
set -euo pipefail
build=$1 out=$2
shift 2
[[ -e $out ]] && { echo "error: $out exists; results are never overwritten" >&2; exit 2; }
mkdir -p "$out"
lscpu >"$out/lscpu.txt"
flags=$(sed -n 's/^Flags: *//p' "$out/lscpu.txt")
configs=("native" "aten=default" "aten=avx2" "onednn=AVX2" "onednn=AVX512_CORE" "gemm=native" "gemm=widened")
[[ " $flags " == *" avx512_bf16 "* || " $flags " == *" amx_bf16 "* ]] || echo "note: no native bf16 GEMMs on this CPU"
run() {  # run CONFIG GRID_FLAGS...
  local config=$1 env=()
  shift
  [[ $config == *aten=* ]] && env+=("ATEN_CPU_CAPABILITY=$(sed 's/.*aten=\([^,]*\).*/\1/' <<<"$config")")
  [[ $config == *onednn=* ]] && env+=("ONEDNN_MAX_CPU_ISA=$(sed 's/.*onednn=\([^,]*\).*/\1/' <<<"$config")")
  [[ $config == *gemm=* ]] && env+=("STREAMBP_NARROW_GEMM=$(sed 's/.*gemm=\([^,]*\).*/\1/' <<<"$config")")
  env "${env[@]}" OMP_NUM_THREADS=1 "$build/streambp_precision_grid" --out "$out/grid-${config//[=,]/-}.csv" "$@" \
    2>"$out/grid-${config//[=,]/-}.log"
  echo "done: $config"
}
export -f run
export build out
printf '%s\n' "${configs[@]}" | xargs -P 2 -I{} bash -c 'run "$@"' _ {} "$@"
gzip -9 "$out"/grid-*.csv
python3 "$(dirname "$0")/summarize.py" "$out" >"$out/summary.md"
"${PYTHON:-python3}" "$(dirname "$0")/../../plots/plot_rule.py" "$out"
