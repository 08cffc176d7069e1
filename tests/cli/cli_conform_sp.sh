# `streambp conform`'s sequence-parallel cases (issue #45), on the quick matrix's fp64 SFT selection: its two SP cases
# (W = 2 ranks with T = 37; W = 3 with T = 38, T mod 3 = 2) are judged, the other four are N/A for an SP adapter
# (declined before torch starts):
# (a) HF under a sequence split on Gloo ranks, the loss over the GLOBAL target count and the gradients summed
#     (verify/conform/hf_sp_adapter.py), passes both at the fp64 bar; --list-cases and case.json say "parallel";
# (b) the negative controls (tests/support/conform_sp_faulty_adapter.py) fail, naming a tensor at least 5x beyond the
#     bar: each rank over its own target count (summed; or averaged: a mean of shard means), the ranks' gradients
#     averaged instead of summed (the first on both cases, the others on W = 3); a split that drops the T mod W last
#     positions fails W = 3 and passes W = 2 (the one position it drops predicts nothing: a blind spot of any
#     T mod W = 1 case);
# (c) a rank that dies, or hangs, ends its case with a verdict naming the rank; conform never hangs;
# (d) a case file's "parallel" is checked: unknown, or "sequence" on one rank, exits 2 naming it.
# Usage: cli_conform_sp.sh BINARY PYTHON
# ctest-needs-python
# ctest-timeout: 600
# ctest-cost: 50
source "$(dirname "$0")/../support/cli_common.sh"
PY=$2
SRC=$(cd "$(dirname "$0")/../.." && pwd)
warm_adapters "$PY"  # the adapters' imports once, not once per case (cli_conform_warm.sh)
export OMP_NUM_THREADS=1
sp=(--cases quick --objectives sft --dtypes fp64)

"$STREAMBP" conform "${sp[@]}" --list-cases >list.json || fail "--list-cases"
python3 - list.json <<'PY' || fail "--list-cases:\n$(cat list.json)"
import json, sys
cases = {c["name"]: c for c in json.load(open(sys.argv[1]))}
assert (cases["sft-sp2-T37"]["ranks"], cases["sft-sp2-T37"]["parallel"]) == (2, "sequence"), cases["sft-sp2-T37"]
assert (cases["sft-sp3-T38"]["ranks"], cases["sft-sp3-T38"]["parallel"]) == (3, "sequence"), cases["sft-sp3-T38"]
assert all(c["parallel"] == "data" for n, c in cases.items() if "-sp" not in n)
PY

verdicts() {  # verdicts CSV: "case=status:worst_tensor:worst" for the SP cases
  python3 - "$1" <<'PY'
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if "-sp" in r["case"]]
print(" ".join(f"{r['case']}={r['status']}:{r['worst_tensor']}:{r['worst']}" for r in rows))
PY
}

# (a)
"$STREAMBP" conform --impl "$PY $SRC/verify/conform/hf_sp_adapter.py" "${sp[@]}" --out ok >ok.txt 2>ok.log ||
  fail "the SP adapter does not pass:\n$(cat ok.txt ok.log)"
grep -q "2 of 2 case(s) passed (7 more not expressible by the implementation)" ok.txt || fail "(a):\n$(cat ok.txt)"
echo "ok: HF under a sequence split passes: $(verdicts ok/conform-*.csv)"

# (b) every fault fails the cases it must, judged on its gradients (a tensor named, >= 5x the fp64 bar 1e-10)
faulty() {  # faulty MODE [conform flags]: runs the fault, leaves MODE.txt and MODE/conform-*.csv
  local mode=$1
  shift
  "$STREAMBP" conform --impl "$PY $SRC/tests/support/conform_sp_faulty_adapter.py $mode" --out "$mode" "$@" \
    >"$mode.txt" 2>"$mode.log" && fail "$mode passed:\n$(cat "$mode.txt")"
  true
}
expect() {  # expect MODE CASE passed|failed
  python3 - "$1"/conform-*.csv "$2" "$3" <<'PY' || fail "$1 on $2: not $3:\n$(cat "$1.txt")"
import csv, sys
row = next(r for r in csv.DictReader(open(sys.argv[1])) if r["case"] == sys.argv[2])
assert row["status"] == sys.argv[3], row
if sys.argv[3] == "failed":
    assert row["worst_tensor"] and float(row["worst"]) >= 5e-10, row
PY
}
# The rank's own target count (the issue's control) on both cases; its variants on W = 3 alone (each rank's count
# differs there, so any per-rank normaliser shows).
faulty own-count "${sp[@]}"
expect own-count sft-sp2-T37 failed
expect own-count sft-sp3-T38 failed
echo "ok: own-count fails: $(verdicts own-count/conform-*.csv)"
for mode in mean-of-means rank-mean; do
  faulty $mode "${sp[@]}" --only sft-sp3-T38
  expect $mode sft-sp3-T38 failed
  echo "ok: $mode fails: $(verdicts $mode/conform-*.csv)"
done
faulty drop-remainder "${sp[@]}"
expect drop-remainder sft-sp3-T38 failed
expect drop-remainder sft-sp2-T37 passed
echo "ok: drop-remainder fails W = 3 and passes W = 2: $(verdicts drop-remainder/conform-*.csv)"

# (c) one small case on 2 ranks; a hang ends at --timeout, the SIGTERM's grace naming the rank still computing
echo '[{"name": "sp2", "seq": 9, "batch": 2, "ranks": 2, "parallel": "sequence"}]' >sp2.json
faulty die --cases sp2.json
grep -qE "FAIL .*exited with status 1: rank 1 died \(killed by signal SIGKILL\) while computing its shard" die.txt ||
  fail "a dying rank is not named:\n$(cat die.txt)"
echo "ok: a dying rank: $(grep -m1 -oE "rank 1 died.{0,80}" die.txt)"
faulty hang --cases sp2.json --timeout 15  # ~1 s to reach the stuck state, warm; 15x that under load
stuck="rank 0 in the target count's all-reduce, rank 1 computing its shard"
grep -qE "FAIL .*timed out after 15 s \(--timeout\): stopped \(SIGTERM\) before every rank finished: $stuck" hang.txt ||
  fail "a hanging rank is not named:\n$(cat hang.txt)"
echo "ok: a hanging rank: $(grep -m1 -oE "stopped \(SIGTERM\).{0,120}" hang.txt)"

# (d)
echo '[{"name": "x", "ranks": 2, "parallel": "tensor"}]' >bad.json
expect_exit_2 "an unknown parallel" "case 0: parallel 'tensor': data or sequence" \
  "$STREAMBP" conform --impl true --cases bad.json
echo '[{"name": "x", "parallel": "sequence"}]' >one.json
expect_exit_2 "sequence on one rank" "case 0: parallel 'sequence' needs ranks >= 2" \
  "$STREAMBP" conform --impl true --cases one.json
