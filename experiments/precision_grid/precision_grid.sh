#!/usr/bin/env bash
# The low-precision rule's statistic over every CPU configuration this machine can reach (issue #28): the grid of
# streambp_precision_grid (seeds x models x objectives x full/LoRA x fp32/bf16/bf16-mixed x exact methods) once per
# configuration of the two knobs that choose kernels: ATEN_CPU_CAPABILITY (ATen's own vectorised kernels: norms,
# reductions, elementwise) and ONEDNN_MAX_CPU_ISA (oneDNN's GEMMs), and each bf16 GEMM path pinned
# (STREAMBP_NARROW_GEMM=native|widened, core/model/gemm.h): the rule must hold on both.
# Configurations the CPU cannot run are skipped (ATen clamps a capability to the CPU's own; oneDNN its ISA cap).
#   [CONFIGS="native aten=default"] experiments/precision_grid/precision_grid.sh BUILD OUT_DIR [grid flags, e.g. --seeds 20]
# Writes OUT_DIR/grid-<config>-<models>.csv (+ .json provenance) per configuration, OUT_DIR/lscpu.txt, then the summary
# and the figure (plots/plot_rule.py) over every grid file in OUT_DIR, so that several calls (each model with its own
# configurations) fill one directory. A grid file is never overwritten. Configurations run two at a time, one thread
# each. CONFIGS chooses configurations (default: all seven).
set -euo pipefail
build=$1 out=$2
shift 2
models=tiny-d128-small
for ((i = 1; i < $#; ++i)); do [[ ${!i} == --models ]] && { j=$((i + 1)); models=${!j//,/-}; }; done
mkdir -p "$out"
lscpu >"$out/lscpu.txt"
flags=$(sed -n 's/^Flags: *//p' "$out/lscpu.txt")
read -r -a configs <<<"${CONFIGS:-native aten=default aten=avx2 onednn=AVX2 onednn=AVX512_CORE gemm=native gemm=widened}"
for config in "${configs[@]}"; do
  f="$out/grid-${config//[=,]/-}-$models.csv"
  [[ -e $f || -e $f.gz ]] && { echo "error: $f exists; results are never overwritten" >&2; exit 2; }
done
[[ " $flags " == *" avx512_bf16 "* || " $flags " == *" amx_bf16 "* ]] || echo "note: no native bf16 GEMMs on this CPU"
run() {  # run CONFIG GRID_FLAGS...
  local config=$1 env=()
  shift
  [[ $config == *aten=* ]] && env+=("ATEN_CPU_CAPABILITY=$(sed 's/.*aten=\([^,]*\).*/\1/' <<<"$config")")
  [[ $config == *onednn=* ]] && env+=("ONEDNN_MAX_CPU_ISA=$(sed 's/.*onednn=\([^,]*\).*/\1/' <<<"$config")")
  [[ $config == *gemm=* ]] && env+=("STREAMBP_NARROW_GEMM=$(sed 's/.*gemm=\([^,]*\).*/\1/' <<<"$config")")
  local file="$out/grid-${config//[=,]/-}-$models"
  env "${env[@]}" OMP_NUM_THREADS=1 "$build/streambp_precision_grid" --out "$file.csv" "$@" 2>"$file.log"
  echo "done: $config"
}
export -f run
export build out models
printf '%s\n' "${configs[@]}" | xargs -P 2 -I{} bash -c 'run "$@"' _ {} "$@"
for config in "${configs[@]}"; do gzip -9 "$out/grid-${config//[=,]/-}-$models.csv"; done
python3 "$(dirname "$0")/summarize.py" "$out" >"$out/summary.md"
"${PYTHON:-python3}" "$(dirname "$0")/../../plots/plot_rule.py" "$out"
