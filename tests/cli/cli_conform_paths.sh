# `streambp conform` on training paths (issue #45), tiny T = 13 cases, HF in the venv's python:
# (a) the shipped HF adapter passes micro-batch steps (SFT, GRPO, DPO; 1-2 rows per micro-batch, each its own target
#     count) and tied and untied heads, the micro-batch rows naming the normalisation they were judged against;
# (b) negative controls (tests/support/conform_wrong_paths.py): a mean of micro-batch means fails exactly the
#     micro-batch cases naming the tensor, and passes them when judged against that declared normalisation
#     (--accumulation micro-means); dropping the tied head's use of the embedding fails exactly the tied cases, naming
#     model.embed_tokens.weight; a skipped last micro-batch fails naming a tensor; a result.json without
#     "micro_batches" is named;
# (c) malformed micro_batches in a --cases file exit 2 naming the case and the rows;
# (d) packed rows (issue #59; tests/support/conform_packing_faults.py), on the ci set's packed case (HF passes it in
#     cli_conform_hf.sh): attention across the boundaries (attention_mask only), positions not restarted (the
#     block-diagonal mask kept), one separator label kept: each fails naming a tensor, at least 5x beyond the bar;
#     packed GRPO (quick's grpo-packed, per-sequence means and ratio, and grpo-packed-micro2, 2 micro-batches of
#     packs): HF's packed path with per-sequence terms passes both (grpo-packed in cli_conform_hf.sh), and each
#     per-row (per-pack) term fails both naming a tensor: one advantage per pack (row-advantage), each pack counted
#     as one completion (pack-normaliser).
# Usage: cli_conform_paths.sh BINARY PYTHON
# ctest-needs-python
# ctest-timeout: 900
# ctest-cost: 40
source "$(dirname "$0")/../support/cli_common.sh"
PY=$2
SRC=$(cd "$(dirname "$0")/../.." && pwd)
export STREAMBP_PYTHON=$PY
warm_adapters "$PY"  # the adapters' imports once, not once per case (cli_conform_warm.sh)
wrong="$PY $SRC/tests/support/conform_wrong_paths.py"

cat >paths.json <<'JSON'
[{"name": "sft-micro3", "batch": 4, "seq": 13, "micro_batches": [[0], [1, 2], [3]]},
 {"name": "grpo-micro2", "objective": "grpo:beta=0.04,loss_type=grpo", "group": 3, "batch": 3, "seq": 13,
  "micro_batches": [[0, 1], [2]]},
 {"name": "dpo-micro2-untied", "objective": "dpo:beta=0.1", "tie_word_embeddings": false, "batch": 6, "seq": 13,
  "micro_batches": [[0, 1, 3, 4], [2, 5]]},
 {"name": "sft-tied", "batch": 3, "seq": 13}]
JSON
echo '[{"name": "sft-micro3", "batch": 4, "seq": 13, "micro_batches": [[0], [1, 2], [3]]}]' >micro.json

# verdicts RUN CASES PASSED [TENSOR]: run RUN's CSV passed exactly the cases PASSED (space-separated, sorted) of
# CASES; each failure judged on its gradients at least 5x beyond its bar, naming TENSOR when given
verdicts() {
  python3 - "$1"/conform-*.csv "$2" "$3" "${4:-}" <<'PY' || fail "$1's verdicts:\n$(cat "$1.txt")"
import csv, sys
rows = {r["case"]: r for r in csv.DictReader(open(sys.argv[1]))}
assert sorted(rows) == sorted(sys.argv[2].split()), sorted(rows)
passed = sorted(c for c, r in rows.items() if r["status"] == "passed")
assert passed == sorted(sys.argv[3].split()), passed
for case, r in rows.items():
    micro = "micro" in case
    assert bool(r["accumulation"]) == micro, r  # a micro-batch row names its normalisation, no other row has one
    if r["status"] == "failed":
        assert r["worst_tensor"] and float(r["worst"]) >= 5e-10, r
        assert not sys.argv[4] or r["worst_tensor"] == sys.argv[4], r
print("ok:", sys.argv[1].split("/")[0], "passed", passed or "none")
PY
}
run() {  # run NAME IMPL CASES [flags]: conform's exit status in NAME.status
  local name=$1 impl=$2 cases=$3 status=0
  shift 3
  "$STREAMBP" conform --impl "$impl" --cases "$cases" --out "$name" "$@" >"$name.txt" 2>"$name.log" || status=$?
  echo "$status" >"$name.status"
}
all="sft-micro3 grpo-micro2 dpo-micro2-untied sft-tied"

# (a)
run hf hf paths.json
[[ $(cat hf.status) -eq 0 ]] || fail "HF on training paths:\n$(cat hf.txt hf.log)"
verdicts hf "$all" "$all"
grep -q "union: the loss over the union of the micro-batches" hf/conform-*.csv || fail "no normalisation named"

# (b)
run means "$wrong micro-means" paths.json
[[ $(cat means.status) -eq 1 ]] || fail "a mean of micro-batch means: exit $(cat means.status)"
verdicts means "$all" "sft-tied"
grep -qE "sft-micro3 .* FAIL .*a step of 3 micro-batches judged against union" means.txt ||
  fail "no hint:\n$(cat means.txt)"
run declared "$wrong micro-means" paths.json --accumulation micro-means
[[ $(cat declared.status) -eq 0 ]] || fail "micro-means judged against its declared normalisation:\n$(cat declared.txt)"
verdicts declared "$all" "$all"
grep -q "micro-means: the mean over micro-batches" declared/conform-*.csv || fail "the declared normalisation unnamed"
run untied "$wrong drop-tied-head" paths.json --objectives sft,dpo
verdicts untied "sft-micro3 dpo-micro2-untied sft-tied" "dpo-micro2-untied" model.embed_tokens.weight
run skip "$wrong skip-last" micro.json
verdicts skip sft-micro3 ""
run uncounted "$wrong uncounted" micro.json
[[ $(cat uncounted.status) -eq 1 ]] &&
  grep -q 'result.json has no "micro_batches"; the case.s step is 3 micro-batches' uncounted.txt ||
  fail "a result.json without micro_batches:\n$(cat uncounted.txt)"
echo "ok: a result.json without micro_batches is named"

# (c)
bad() {  # bad JSON PATTERN
  echo "$1" >bad.json
  expect_exit_2 "micro_batches $1" "$2" "$STREAMBP" conform --impl true --cases bad.json
}
bad '[{"name": "a", "batch": 3, "micro_batches": [[0, 1], [1, 2]]}]' "case 0: micro_batches: row 1 appears twice"
bad '[{"name": "a", "batch": 3, "micro_batches": [[0], [2]]}]' "case 0: micro_batches: row 1 is in no micro-batch"
bad '[{"name": "a", "batch": 3, "micro_batches": [[0, 1, 2], []]}]' "case 0: micro_batches\[1\] is empty"
bad '[{"name": "a", "objective": "dpo", "batch": 4, "micro_batches": [[0, 1], [2, 3]]}]' \
  "case 0: micro_batches\[0\]: dpo's micro-batch is its chosen rows, then their rejected rows"
bad '[{"name": "a", "batch": 3, "micro_batches": [[0, "x"]]}]' "case 0: .*type must be number"

# (d)
for fault in cross-boundary positions separator; do
  run "packed-$fault" "$PY $SRC/tests/support/conform_packing_faults.py $fault" ci --only sft-packed
  [[ $(cat "packed-$fault.status") -eq 1 ]] || fail "packing fault $fault: exit $(cat "packed-$fault.status")"
  verdicts "packed-$fault" sft-packed ""
  grep -q "a packed case: usually attention across a sequence boundary" "packed-$fault.txt" ||
    fail "packing fault $fault: no packed hint:\n$(cat "packed-$fault.txt")"
done
# HF passes grpo-packed in cli_conform_hf.sh (the ci set); here its micro-batches of packs
run packed-grpo hf quick --only grpo-packed-micro2
[[ $(cat packed-grpo.status) -eq 0 ]] || fail "HF on packed GRPO:\n$(cat packed-grpo.txt packed-grpo.log)"
verdicts packed-grpo grpo-packed-micro2 grpo-packed-micro2
for fault in row-advantage pack-normaliser; do
  run "packed-$fault" "$PY $SRC/tests/support/conform_packing_faults.py $fault" quick --only grpo-packed,grpo-packed-micro2
  [[ $(cat "packed-$fault.status") -eq 1 ]] || fail "packed GRPO fault $fault: exit $(cat "packed-$fault.status")"
  verdicts "packed-$fault" "grpo-packed grpo-packed-micro2" ""
  [[ $(grep -c "or a per-sequence term of GRPO taken per row (pack)" "packed-$fault.txt") -ge 2 ]] ||
    fail "packed GRPO fault $fault: no packed GRPO hint:\n$(cat "packed-$fault.txt")"
done
