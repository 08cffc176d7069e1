#!/bin/bash
# The known-bug table's micro-batch slice in `make test` (issue #45), beside cli_known_bugs.sh: HF's own Trainer with
# gradient accumulation (verify/conform/survey/hf_trainer.py, venvs cached in ~/.cache/streambp/survey) on a small
# step of 3 micro-batches with different target counts:
#   - transformers 4.45.2 (before PR #34191: the mean of the micro-batches' means) must fail naming a tensor, 4.46.0
#     must pass, and known_bugs.py must call the bug recalled (its negative control, a buggy pin that passes being a
#     miss, is cli_known_bugs.sh's).
# Usage: cli_known_bugs_accumulation.sh BINARY PYTHON
# ctest-needs-python
# ctest-timeout: 900
# ctest-cost: 150
source "$(dirname "$0")/../support/cli_common.sh"
PY=$2
SRC=$(cd "$(dirname "$0")/../.." && pwd)
export STREAMBP_PYTHON=$PY OMP_NUM_THREADS=1
CASES=$SRC/tests/cli/known_bugs_accumulation_slice.json

"$PY" "$SRC/experiments/survey/survey.py" --streambp "$STREAMBP" --no-time-reference \
  --cases "$CASES" \
  --only transformers-4.45.2-trainer transformers-4.46.0-trainer --out survey --allow-dirty >survey.txt 2>survey.log ||
  fail "survey.py:\n$(tail -20 survey.log)\n$(cat survey.txt)"
"$PY" "$SRC/experiments/survey/known_bugs.py" --survey survey >known.txt 2>known.log ||
  fail "known_bugs.py on the slice:\n$(cat known.log)\n$(cat survey.txt)"
python3 - survey/known-bugs.csv <<'PY' || fail "the slice's recall row:\n$(cat survey/known-bugs.md)"
import csv, sys
row = next(r for r in csv.DictReader(open(sys.argv[1])) if r["buggy_entry"] == "transformers-4.45.2-trainer")
print({k: row[k] for k in ("buggy_verdict", "worst_tensor", "buggy_error", "fixed_verdict", "recall")})
assert row["recall"] == "recalled" and row["worst_tensor"], row
PY
echo "ok: transformers 4.45.2's accumulation bug recalled ($(grep -m1 'PR #34191' survey/known-bugs.md | cut -c1-160))"

