#!/bin/bash
# The known-bug recall table's slice in `make test` (issue #45): one public bug at its buggy and its fixed PyPI pin
# through the survey (experiments/survey/survey.py, venvs cached in ~/.cache/streambp/survey after the first run):
#   - DeepSpeed 0.17.2's TiledMLP (before PR #7422: with two rows a shard's gradient is read at another row's
#     positions) must fail naming a tensor, 0.17.3's must be exact, and known_bugs.py must call the bug recalled;
#   - negative control: the same rows with the buggy pin's verdict turned into a pass make known_bugs.py exit 1
#     with the bug "missed".
# Usage: cli_known_bugs.sh BINARY PYTHON
# ctest-needs-python
# ctest-timeout: 900
# ctest-cost: 70
source "$(dirname "$0")/../support/cli_common.sh"
PY=$2
SRC=$(cd "$(dirname "$0")/../.." && pwd)
export STREAMBP_PYTHON=$PY OMP_NUM_THREADS=1

"$PY" "$SRC/experiments/survey/survey.py" --streambp "$STREAMBP" --no-time-reference \
  --cases "$SRC/tests/cli/known_bugs_slice.json" \
  --only deepspeed-0.17.2-tiled-mlp deepspeed-0.17.3-tiled-mlp --out survey --allow-dirty >survey.txt 2>survey.log ||
  fail "survey.py:\n$(tail -20 survey.log)\n$(cat survey.txt)"
"$PY" "$SRC/experiments/survey/known_bugs.py" --survey survey >known.txt 2>known.log ||
  fail "known_bugs.py on the slice:\n$(cat known.log)\n$(cat survey.txt)"
python3 - survey/known-bugs.csv <<'PY' || fail "the slice's recall row:\n$(cat survey/known-bugs.md)"
import csv, sys
row = next(r for r in csv.DictReader(open(sys.argv[1])) if r["buggy_entry"] == "deepspeed-0.17.2-tiled-mlp")
print({k: row[k] for k in ("buggy_verdict", "worst_tensor", "buggy_error", "fixed_verdict", "recall", "command")})
assert row["recall"] == "recalled" and row["worst_tensor"].startswith("model.layers."), row
assert row["command"] == 'make survey SURVEY_ARGS="--only deepspeed-0.17.2-tiled-mlp deepspeed-0.17.3-tiled-mlp"', row
PY
echo "ok: DeepSpeed 0.17.2's TiledMLP bug recalled ($(grep -m1 'PR #7422' survey/known-bugs.md | cut -c1-160))"

# negative control: the buggy pin passing must be a miss, and an exit 1
mkdir masked
python3 - survey/survey-*.csv masked/survey-masked.csv <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
for r in rows:
    if r["implementation"] == "deepspeed-0.17.2-tiled-mlp" and r["status"] == "failed":
        r.update(status="passed", verdict="exact", worst="1e-16")
with open(sys.argv[2], "w", newline="") as f:
    w = csv.DictWriter(f, rows[0].keys())
    w.writeheader()
    w.writerows(rows)
PY
expect_failure "a buggy pin that passes is a miss" "PR #7422: missed" \
  "$PY" "$SRC/experiments/survey/known_bugs.py" --survey masked
