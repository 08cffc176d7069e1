#!/bin/bash
# The survey's sequence-parallel slice in `make test` (issue #45), beside the micro-batch one
# (cli_known_bugs_accumulation.sh): DeepSpeed 0.19.8 on 2 sequence-parallel Gloo ranks (venv cached in
# ~/.cache/streambp/survey), one small untied SFT case:
#   - ArcticTraining's SFT loss path (TiledFusedLogitsLoss with its all-gather aggregation; arctic_sft.py) must fail,
#     naming lm_head.weight far beyond the fp64 bar: the head's gradient is made inside the forward, where no later
#     division reaches it (docs/survey.md; results/survey/reports/);
#   - DeepSpeed's own Ulysses path (deepspeed_ulysses.py), the same pin and ranks, must be exact.
# Usage: cli_known_bugs_sp.sh BINARY PYTHON
# ctest-needs-python
# ctest-timeout: 900
# ctest-cost: 160
source "$(dirname "$0")/../support/cli_common.sh"
PY=$2
SRC=$(cd "$(dirname "$0")/../.." && pwd)
export STREAMBP_PYTHON=$PY OMP_NUM_THREADS=1
# DeepSpeed JIT-builds ops into TORCH_EXTENSIONS_DIR: the adapters skip its inference-only shared-memory op
# (deepspeed_common.init_distributed_gloo: two CPU-minutes on a fresh machine), so nothing may be built here.
export TORCH_EXTENSIONS_DIR=$WORK/torch_extensions
mkdir -p "$TORCH_EXTENSIONS_DIR"

"$PY" "$SRC/experiments/survey/survey.py" --streambp "$STREAMBP" --no-time-reference \
  --cases "$SRC/tests/cli/known_bugs_sp_slice.json" \
  --only arctic-sft-zero2 deepspeed-ulysses --out survey --allow-dirty >survey.txt 2>survey.log ||
  fail "survey.py:\n$(tail -20 survey.log)\n$(cat survey.txt)"
python3 - survey/survey-*.csv <<'PY' || fail "the SP slice's verdicts:\n$(cat survey.txt)\n$(tail -20 survey.log)"
import csv, sys
rows = {r["implementation"]: r for r in csv.DictReader(open(sys.argv[1])) if r["judged"] not in ("", "0")}
for name in ("arctic-sft-zero2", "deepspeed-ulysses"):
    r = rows[name]
    print(f"{name:20} {r['verdict']:10} {r['worst_tensor']} {r['worst']}")
bad, good = rows["arctic-sft-zero2"], rows["deepspeed-ulysses"]
assert bad["verdict"] == "wrong" and bad["worst_tensor"] == "lm_head.weight" and float(bad["worst"]) >= 1, bad
assert good["verdict"] == "exact", good
PY
built=$(find "$TORCH_EXTENSIONS_DIR" -name '*.so' 2>/dev/null)
[[ -z $built ]] || fail "DeepSpeed JIT-built an op the adapters skip: $built"
echo "ok: ArcticTraining's SP loss path fails naming lm_head.weight; DeepSpeed's Ulysses path at the same pin is exact"
