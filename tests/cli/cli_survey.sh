#!/bin/bash
# The survey's slice in `make test` (issue #33): real public code through `streambp conform`, installed from PyPI
# at pinned versions into the survey's venvs (experiments/survey/survey.py: the harness venv's packages beneath, so a
# venv is deepspeed and its few dependencies; cached in ~/.cache/streambp/survey after the first run):
#   - DeepSpeed 0.19.8's TiledMLP + TiledFusedLogitsLoss, called with the batch's normaliser, must be exact;
#   - DeepSpeed 0.19.7's TiledLoss (removed by PR #8587: each tile's own mean in the backward, averaged over the
#     tiles, while the forward is right) must fail, on the tiled case, with a gradient error far beyond the bar;
#   - HF under DDP on 2 Gloo ranks must be exact on the case for 2 ranks (the distributed check against one process);
#   - every row's command replays from any checkout: no path of this checkout or this home in it.
# A change to conform that stops catching a real library's bug turns this red.
# Usage: cli_survey.sh BINARY PYTHON
# ctest-needs-python
# ctest-timeout: 1500
# ctest-cost: 115
source "$(dirname "$0")/../support/cli_common.sh"
PY=$2
SRC=$(cd "$(dirname "$0")/../.." && pwd)
export STREAMBP_PYTHON=$PY OMP_NUM_THREADS=1

"$PY" "$SRC/experiments/survey/survey.py" --streambp "$STREAMBP" --no-time-reference \
  --cases "$SRC/tests/cli/survey_slice.json" \
  --only deepspeed-tiled deepspeed-tiledloss hf-ddp --out survey --allow-dirty >survey.txt 2>survey.log ||
  fail "survey.py:\n$(tail -20 survey.log)\n$(cat survey.txt)"
python3 - survey/survey-*.csv "$SRC" "$HOME" <<'PY' || fail "the slice's verdicts:\n$(cat survey.txt)\n$(tail -20 survey.log)"
import csv, sys
rows = {}
for r in csv.DictReader(open(sys.argv[1])):
    rows.setdefault(r["implementation"], []).append(r)
for name in ("deepspeed-tiled", "deepspeed-tiledloss", "hf-ddp"):
    for r in rows[name]:
        print(f"{name:22} {r['setting'][-20:]:>20} {r['verdict']:16} {r['worst_tensor']} {r['worst']} {r['cause'][:300]}")
tiled = [r for r in rows["deepspeed-tiled"] if r["judged"] not in ("", "0")]
assert tiled and all(r["verdict"] == "exact" for r in tiled), rows["deepspeed-tiled"]
old = [r for r in rows["deepspeed-tiledloss"] if r["judged"] not in ("", "0")]
assert any(r["verdict"] == "wrong" and float(r["worst"]) > 1e-3 for r in old), rows["deepspeed-tiledloss"]
ddp = [r for r in rows["hf-ddp"] if "2 ranks" in r["setting"]]
assert ddp and ddp[0]["verdict"] == "exact", rows["hf-ddp"]
local = [r["command"] for rs in rows.values() for r in rs if sys.argv[2] in r["command"] or sys.argv[3] in r["command"]]
assert not local, f"a command with this machine's paths: {local[0]}"
PY
echo "ok: DeepSpeed's tiled pieces exact, its removed TiledLoss caught, HF DDP on 2 ranks exact"
