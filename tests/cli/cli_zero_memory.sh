# The per-rank memory model of data-parallel training against real Gloo ranks (separate processes, each with its own
# meter): `streambp train --nproc N --zero S --json` reports every rank's peak and the model of one rank (rank 0's
# slices, the longest); the largest rank peak must be within 3% of it. (tests/unit/test_zero_memory.cpp covers the grid
# in one process with ranks that behave like Gloo's; this is the check that they do.) And `project --world --zero`:
# the paper's Table 4 as a projection, and its bad input rejected with exit 2.
# ctest-timeout: 300
source "$(dirname "$0")/../support/cli_common.sh"

common=(--preset tiny --dtype fp32 --steps 3 --seed 5 --optimizer adamw:lr=1e-3,weight_decay=0.1 --clip-grad-norm 0.5)
check_rank_peaks() {  # check_rank_peaks NAME NPROC ZERO [train flags]
  local name=$1 n=$2 zero=$3
  shift 3
  "$STREAMBP" train "${common[@]}" --nproc "$n" --zero "$zero" --json "$name.json" "$@" 2>"$name.log" ||
    fail "$name:\n$(cat "$name.log")"
  python3 - "$name.json" "$n" "$zero" <<'PY' || fail "$name: rank peaks and the model differ:\n$(cat "$name.json")"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["world_size"] == int(sys.argv[2]) and j["zero"] == int(sys.argv[3]), j
peak, model = max(j["rank_peak_bytes"]), j["model_peak_bytes"]
print(f"{sys.argv[1]}: rank peaks {j['rank_peak_bytes']}, model {model} at {j['model_peak_moment']}: {peak / model:.4f}")
assert abs(peak / model - 1) <= 0.03
PY
  grep -q "analytic per rank of $n" "$name.log" || fail "$name: no per-rank line:\n$(cat "$name.log")"
}
# T = 16: the collectives and the update decide the peak; T = 256: the BP, with sharded gradients (and parameters).
check_rank_peaks ddp2 2 0 --batch 4 --seq 16 --method streambp:layer_chunk=64,head_chunk=64
check_rank_peaks zero1 3 1 --batch 6 --seq 16 --method checkpoint
check_rank_peaks zero2 3 2 --batch 6 --seq 16 --method streambp:layer_chunk=64,head_chunk=64
check_rank_peaks zero2-bp 2 2 --batch 4 --seq 256 --method checkpoint
check_rank_peaks zero3 3 3 --batch 6 --seq 256 --method streambp:layer_chunk=64,head_chunk=64

# project: Table 4 beside the paper's numbers; each world size a row per method.
"$STREAMBP" project --world 3,4,5,6,7,8 --zero 2 --out "$WORK/projection" >table4.txt || fail "project:\n$(cat table4.txt)"
grep -q "Table 4" table4.txt && [[ $(grep -c "^| [3-8] | " table4.txt) -eq 12 ]] || fail "no Table 4 rows:\n$(cat table4.txt)"
grep -q "| 8 | streambp:layer_chunk=500,head_chunk=100 | .* | 131.8k |" table4.txt ||
  fail "no paper number beside the projection:\n$(cat table4.txt)"
echo "ok: project --world 3..8 --zero 2"
expect_exit_2 "--world 0" "world size is at least 1" "$STREAMBP" project --world 0 --zero 2 --out p
expect_exit_2 "--zero 4" "ZeRO stage is 0" "$STREAMBP" project --world 3 --zero 4 --out p
expect_exit_2 "--zero -1" "ZeRO stage is 0" "$STREAMBP" project --world 3 --zero -1 --out p
expect_exit_2 "--zero without --world" "needs --world" "$STREAMBP" project --zero 2 --out p
