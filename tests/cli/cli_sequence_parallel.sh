# `streambp train --nproc N --sp S` (issue #32): each sequence split over S ranks (all-gather context parallelism,
# zig-zag split), N / S data-parallel groups, ranks launched as fresh processes over Gloo.
# (a) StreamBP over 2 ranks of one sequence each, checkpointing over DP x SP = 2 x 2 with ZeRO-3, and DPO with
#     StreamBP over 3 ranks end 3 fp64 AdamW steps within 1e-12 (normwise, every tensor) of one process of standard
#     BP over the same global batches (T = 37: not divisible; padded rows, masked prompts); the metrics count the
#     group's collectives as the formula says (sequence_step_collectives);
#     maxlen --nproc 2 --sp 2 measures T* per rank beside its model;
# (b) a rank killed mid-run, under the all-gather and the ring: the launcher exits non-zero within the timeout naming
#     the rank, no rank left running; the ring's ranks started by hand: the survivor ends alone as a peer failure;
# (c) bad input exits 2 naming it: --nproc not a multiple of --sp, --sp on one process, a method that does not run on
#     a shard (MsT), and ranks started by hand with different --sp;
# (d) packed rows (--pack) with sequences across ranks: StreamBP over 2 ranks (all-gather) and checkpointing over 3
#     (ring) end 3 fp64 SGD steps within 1e-12 of one process (issue #59 item 4; every method, both schemes, the
#     gradients themselves and the negative controls are test_packed_sequence_parallel's, in process); and GRPO on
#     packed rows (sequence-level ratio: each sequence's log-ratio summed over the ranks holding it) over 3 ranks
#     (ring), 2 data-parallel ranks and 2 accumulated micro-batches, each within 1e-12 of one process.
# ctest-timeout: 240
# ctest-cost: 44
source "$(dirname "$0")/../support/cli_common.sh"

common=(--preset tiny --dtype fp64 --batch 4 --seq 37 --pad-fraction 0.4 --prompt-fraction 0.2 --steps 3 --seed 5
        --optimizer adamw:lr=1e-2,weight_decay=0.1 --lr-schedule cosine,warmup=1 --clip-grad-norm 1)
"$STREAMBP" train "${common[@]}" --method standard --save-model single 2>single.log ||
  fail "single process:\n$(cat single.log)"
# name nproc sp zero method [flags...]
run() {
  local name=$1 nproc=$2 sp=$3 zero=$4 method=$5
  shift 5
  "$STREAMBP" train "${common[@]}" --method "$method" --nproc "$nproc" --sp "$sp" --zero "$zero" "$@" \
    --metrics "$name.csv" --save-model "$name" 2>"$name.log" || fail "$name:\n$(cat "$name.log")"
}
run sp2 2 2 0 streambp:layer_chunk=4,head_chunk=5
run dpsp 4 2 3 checkpoint
for name in sp2 dpsp; do
  "$STREAMBP" compare single/model.safetensors $name/model.safetensors --rtol 1e-12 >cmp-$name.txt ||
    fail "$name differs from one process:\n$(cat cmp-$name.txt)"
  echo "ok: $name equals one process: $(tail -1 cmp-$name.txt)"
done
grep -q "4 ranks (ZeRO-3, Gloo), each sequence over 2 (2 data-parallel)" dpsp.log ||
  fail "no layout in the progress:\n$(cat dpsp.log)"
# tiny: 2 layers; per step and layer StreamBP and checkpointing exchange K/V twice (forward, then the backward's
# re-forward) and their gradients once, a collective per piece (at most 4) of the rows' K and V; one more all-gather
# checks the sequence length. Bytes: the longest zig-zag shard of T = 37 (over 2: 10 + 9 positions = 19) x K and V x
# rows x 2 KV heads x head_dim 16 x 8 bytes.
python3 - sp2.csv dpsp.csv <<'PY' || fail "metrics:\n$(cat sp2.csv dpsp.csv)"
import csv, sys
for path, rows in (("sp2.csv", 4), ("dpsp.csv", 2)):
    for r in csv.DictReader(open(path)):
        gather = 19 * 2 * rows * 2 * 16 * 8
        pieces = 4  # 2 x rows x 2 KV heads slices (8 or 16): at most 4 pieces, one collective each
        expect = {"sequence_parallel": "2", "sp_all_gather_calls": str(1 + 4 * pieces), "sp_all_gather_bytes": str(8 + 4 * gather),
                  "sp_reduce_scatter_calls": str(2 * pieces), "sp_reduce_scatter_bytes": str(2 * 2 * gather),
                  "sp_all_reduce_calls": "0"}
        got = {k: r[k] for k in expect}
        assert got == expect, (path, got, expect)
PY
echo "ok: the group's collectives per step are the formula's"

dpo=(--objective dpo:beta=0.1)
"$STREAMBP" train "${common[@]}" "${dpo[@]}" --method standard --save-model dpo1 2>dpo1.log ||
  fail "DPO, single process:\n$(cat dpo1.log)"
run dpo3 3 3 0 streambp:layer_chunk=4,head_chunk=5 "${dpo[@]}"
"$STREAMBP" compare dpo1/model.safetensors dpo3/model.safetensors --rtol 1e-12 >cmp-dpo3.txt ||
  fail "DPO --sp 3 differs from one process:\n$(cat cmp-dpo3.txt)"
python3 - dpo3.csv <<'PY' || fail "metrics of DPO --sp 3:\n$(cat dpo3.csv)"
import csv, sys
for r in csv.DictReader(open(sys.argv[1])):
    assert (r["sequence_parallel"], r["sp_all_reduce_calls"], r["sp_all_reduce_bytes"]) == ("3", "1", str(4 * 8)), r  # S of 4 rows
PY
echo "ok: DPO --nproc 3 --sp 3 equals one process (row statistics summed over the group): $(tail -1 cmp-dpo3.txt)"

# maxlen --sp: the longest sequence per rank of a group under a per-rank budget (training steps), measured beside the
# model's prediction; longer than one process's under the same budget (each rank holds half the positions).
budget=(--preset tiny --budget-bytes 3000000 --methods streambp:layer_chunk=64,head_chunk=64 --optimizer adamw:lr=1e-3
        --batch 2)
"$STREAMBP" maxlen "${budget[@]}" --out maxlen1 >maxlen1.txt 2>maxlen1.log || fail "maxlen:\n$(cat maxlen1.log)"
"$STREAMBP" maxlen "${budget[@]}" --nproc 2 --sp 2 --out maxlen2 >maxlen2.txt 2>maxlen2.log ||
  fail "maxlen --sp 2:\n$(cat maxlen2.log)"
python3 - maxlen1/maxlen-*.csv maxlen2/maxlen-*.csv <<'PY' || fail "maxlen CSVs:\n$(cat maxlen1/maxlen-*.csv maxlen2/maxlen-*.csv)"
import csv, sys
one, two = ([r for r in csv.DictReader(open(p)) if r["role"] == "max"][0] for p in sys.argv[1:])
assert two["sequence_parallel"] == "2" and two["world_size"] == "2", two
assert int(two["measured_max_seq"]) > int(one["measured_max_seq"]), (one, two)
assert abs(float(two["model_error"])) <= 0.05, two  # the model's T* within two of the search's 2% steps
print(f"T* {one['measured_max_seq']} on one process, {two['measured_max_seq']} per group of 2 (model {two['model_max_seq']})")
PY
echo "ok: maxlen --nproc 2 --sp 2 measures a longer T* than one process, beside its model"
expect_exit_2 "maxlen --sp 2 with MsT" "method mst.* does not run on a sequence-parallel rank's shard" \
  "$STREAMBP" maxlen --preset tiny --budget-bytes 3000000 --methods mst --optimizer adamw --batch 2 --nproc 2 --sp 2

# (b) SIGKILL to one rank of a long run under each scheme (the ring's with blocks in flight most of the step): the
# launcher names the killed rank within the timeout, exits non-zero, and no rank is left running.
long=(--preset tiny --dtype fp32 --batch 1 --seq 2048 --steps 1000 --method streambp:layer_chunk=256,head_chunk=256 --sp 2
      --dist-timeout 10)
# started PID LOG: waits for step 1 in LOG, then a little into step 2 (a kill lands mid-step, not between steps).
started() {
  for _ in $(seq 1 300); do grep -q "^step 1/" "$2" && { sleep 0.2; return 0; }; kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
  kill -9 $(jobs -p) 2>/dev/null
  fail "no step 1 in 30 s:\n$(cat "$2")"
}
for scheme in allgather ring; do
  "$STREAMBP" train "${long[@]}" --nproc 2 --sp-scheme $scheme 2>kill-$scheme.log &
  launcher=$!
  started $launcher kill-$scheme.log
  mapfile -t kids < <(pgrep -P $launcher || true)
  [[ ${#kids[@]} -eq 2 ]] || { kill -9 $launcher; fail "$scheme: ${#kids[@]} ranks running, expected 2"; }
  victim=$(tr '\0' '\n' </proc/${kids[1]}/environ | sed -n 's/^STREAMBP_RANK=//p')
  kill -KILL "${kids[1]}"
  start=$(date +%s)
  status=0
  wait $launcher || status=$?
  elapsed=$(($(date +%s) - start))
  [[ $status -ne 0 && $status -lt 128 ]] || fail "$scheme: launcher exit $status after SIGKILL to a rank:\n$(cat kill-$scheme.log)"
  grep -qE "streambp: rank $victim of 2 was killed by signal 9" kill-$scheme.log ||
    fail "$scheme: the dead rank ($victim) is not named:\n$(cat kill-$scheme.log)"
  [[ $elapsed -le 10 ]] || fail "$scheme: the survivor took ${elapsed} s to stop (--dist-timeout 10)"
  [[ -z $(pgrep -P $launcher || true) ]] || fail "$scheme: ranks left running"
  echo "ok: a killed rank stops the $scheme run in ${elapsed} s: $(grep -m1 'streambp: rank' kill-$scheme.log)"
done
# The ring's ranks started by hand (as torchrun starts them: no launcher to stop the survivor): rank 1 killed, rank 0
# ends on its own within --dist-timeout as a peer failure (exit 1, the collective it was in named; a hop names its
# peer), never as an internal error (a hop posted to a dead peer once threw past the communicator: exit 70).
mkdir -p store
for r in 0 1; do
  STREAMBP_RANK=$r STREAMBP_WORLD_SIZE=2 STREAMBP_STORE=$PWD/store/killed "$STREAMBP" train "${long[@]}" --sp-scheme ring \
    >killed$r.log 2>&1 &
  pids[r]=$!
done
started "${pids[0]}" killed0.log
kill -KILL "${pids[1]}"
start=$(date +%s)
status=0
wait "${pids[0]}" || status=$?
elapsed=$(($(date +%s) - start))
wait "${pids[1]}" 2>/dev/null || true
[[ $status -eq 1 ]] || fail "the ring's survivor exited $status, expected 1 (a peer failure):\n$(cat killed0.log)"
grep -qE "^streambp: a peer rank failed: rank 0: [a-z_]+( \((send to|recv from) rank 1\))? failed \(a peer died or stalled\?\)" \
  killed0.log || fail "the ring's survivor does not say what failed:\n$(cat killed0.log)"
[[ $elapsed -le 10 ]] || fail "the ring's survivor took ${elapsed} s to stop (--dist-timeout 10)"
echo "ok: the ring's survivor ends alone in ${elapsed} s: $(grep -m1 -o 'rank 0: .* failed' killed0.log)"

# (c) Bad input.
small=(--preset tiny --batch 2 --seq 16 --steps 1 --method standard)
expect_exit_2 "--nproc 3 --sp 2" "^streambp: error: --sp 2: 3 ranks do not form groups of 2" \
  "$STREAMBP" train "${small[@]}" --nproc 3 --sp 2
expect_exit_2 "--sp 2 on one process" "--sp 2 splits each sequence over 2 ranks, and this is one process" \
  "$STREAMBP" train "${small[@]}" --sp 2
expect_exit_2 "--sp 2 with MsT" "method mst.* does not run on a sequence-parallel rank's shard" \
  "$STREAMBP" train "${small[@]/standard/mst}" --nproc 2 --sp 2
expect_ranks_disagree "ranks with different --sp" "disagree on --sp" --sp 1 2 "${small[@]}" --dist-timeout 30

# (d) Packed rows across ranks. --pack fixed:length=13 at T = 41: sequences [0, 13), [13, 26), [26, 39), [39, 41) in
# each row; over 2 ranks (zig-zag parts [0, 11) + [31, 41) and [11, 21) + [21, 31)) [0, 13) and [26, 39) straddle both,
# and rank 0's late part holds the tail of [26, 39) beside [39, 41); over 3 every sequence but the last crosses a rank.
# SGD with momentum and clipping: AdamW's first steps divide each gradient entry by its own size, which turns the
# summation order's 1e-19 on an entry near zero into ~1e-12 of its weight (one step of these packed rows read 3.5e-12
# in an o_proj, StreamBP on one process 7e-13) and would judge that amplification instead of the gradients.
packed=(--preset tiny --dtype fp64 --batch 2 --seq 41 --pack fixed:length=13 --prompt-fraction 0.2 --steps 3 --seed 5
        --optimizer sgd:lr=0.5,momentum=0.9 --clip-grad-norm 1)
"$STREAMBP" train "${packed[@]}" --method standard --save-model packed1 2>packed1.log ||
  fail "packed rows, one process:\n$(cat packed1.log)"
for layout in "2 allgather streambp:layer_chunk=4,head_chunk=5" "3 ring checkpoint"; do
  read -r sp scheme method <<<"$layout"
  name=packed-$sp-$scheme
  "$STREAMBP" train "${packed[@]}" --method "$method" --nproc "$sp" --sp "$sp" --sp-scheme "$scheme" --save-model "$name" \
    2>"$name.log" || fail "$name:\n$(cat "$name.log")"
  "$STREAMBP" compare packed1/model.safetensors "$name/model.safetensors" --rtol 1e-12 >"cmp-$name.txt" ||
    fail "$name differs from one process:\n$(cat "cmp-$name.txt")"
  echo "ok: packed rows, --sp $sp --sp-scheme $scheme ($method) equals one process: $(tail -1 "cmp-$name.txt")"
done
# GRPO on the same packed rows: one completion per sequence, its advantage drawn per sequence. grpo's normaliser counts
# the step's sequences, across data-parallel ranks and micro-batches alike.
grpo=("${packed[@]}" --objective grpo:loss_type=grpo,importance=sequence,beta=0.04)
"$STREAMBP" train "${grpo[@]}" --method standard --save-model grpo1 2>grpo1.log ||
  fail "packed GRPO, one process:\n$(cat grpo1.log)"
for layout in "--nproc 3 --sp 3 --sp-scheme ring --method checkpoint" "--nproc 2 --method standard" \
              "--grad-accum 2 --method streambp:layer_chunk=5,head_chunk=7"; do
  name=grpo-$(echo "$layout" | tr -c 'a-z0-9' '-')
  # shellcheck disable=SC2086  # the layout's flags, split on purpose
  "$STREAMBP" train "${grpo[@]}" $layout --save-model "$name" 2>"$name.log" || fail "packed GRPO, $layout:\n$(cat "$name.log")"
  "$STREAMBP" compare grpo1/model.safetensors "$name/model.safetensors" --rtol 1e-12 >"cmp-$name.txt" ||
    fail "packed GRPO, $layout differs from one process:\n$(cat "cmp-$name.txt")"
  echo "ok: packed GRPO, $layout equals one process: $(tail -1 "cmp-$name.txt")"
done
