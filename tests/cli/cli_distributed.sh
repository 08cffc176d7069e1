# `streambp train --nproc N` (issue #20): data-parallel ranks over Gloo, launched as fresh processes.
# (a) 2 and 3 ranks of StreamBP end 4 fp64 AdamW steps within 1e-12 (normwise, every tensor) of one process of
#     standard BP over the same global batches (right padding: unequal target counts per rank); the metrics say the
#     world size and one all-reduce per gradient group plus the step's totals and loss;
# (b) a rank killed with SIGKILL mid-run: the launcher exits non-zero within the timeout naming the rank and the
#     signal, and no rank is left running; a rank stopped with SIGSTOP: the same within --dist-timeout + grace;
#     ZeRO-2 over 3 ranks and ZeRO-3 (GRPO) over 2 the same; ZeRO checkpoints equal one process's, and resume on
#     another world size and stage;
#     maxlen and sweep seq with --nproc 2 --zero 2 (Tables 4-5);
# (c) bad input exits 2 naming it: ranks started by hand (the launcher's environment) with different --seed, and a
#     global batch whose rows do not split over --nproc.
# ctest-timeout: 300
# ctest-cost: 85
source "$(dirname "$0")/../support/cli_common.sh"

common=(--preset tiny --dtype fp64 --batch 6 --seq 40 --pad-fraction 0.4 --prompt-fraction 0.2 --steps 4 --seed 5
        --optimizer adamw:lr=1e-2,weight_decay=0.1 --lr-schedule cosine,warmup=1 --clip-grad-norm 1)
"$STREAMBP" train "${common[@]}" --method standard --save-model single 2>single.log ||
  fail "single process:\n$(cat single.log)"
for n in 2 3; do
  "$STREAMBP" train "${common[@]}" --method streambp:layer_chunk=16,head_chunk=8 --nproc $n --metrics m$n.csv \
    --json j$n.json --save-model ranks$n 2>ranks$n.log || fail "--nproc $n:\n$(cat ranks$n.log)"
  python3 -c "import json,sys; j=json.load(open('j$n.json')); p=j['rank_peak_bytes']; \
assert j['world_size'] == $n and len(p) == $n and all(x > 0 for x in p), j" || fail "j$n.json:\n$(cat j$n.json)"
  grep -qE "^peak      per rank: rank 0 [^,]+(, rank [0-9]+ [^,]+)*, rank $((n - 1)) [^,]+$" ranks$n.log ||
    fail "--nproc $n: the per-rank peaks are not labelled:\n$(grep '^peak' ranks$n.log)"
  "$STREAMBP" compare single/model.safetensors ranks$n/model.safetensors --rtol 1e-12 >cmp$n.txt ||
    fail "--nproc $n differs from one process:\n$(cat cmp$n.txt)"
  echo "ok: --nproc $n equals one process: $(tail -1 cmp$n.txt)"
  # tiny is tied: the head group is the final norm; 2 layers; the embedding; plus the totals and the loss.
  python3 - m$n.csv $n <<'PY' || fail "metrics of --nproc $n:\n$(cat m$n.csv)"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
assert [r["step"] for r in rows] == ["1", "2", "3", "4"], rows
for r in rows:
    assert r["world_size"] == sys.argv[2] and r["all_reduce_calls"] == "6" and int(r["all_reduce_bytes"]) > 0, r
PY
done
grep -q "ranks (DDP, Gloo)" ranks2.log || fail "no rank count in the progress:\n$(cat ranks2.log)"
# ZeRO-2 over 3 ranks: slices inside every tensor, gradients reduce-scattered per group, parameters all-gathered.
"$STREAMBP" train "${common[@]}" --method streambp:layer_chunk=16,head_chunk=8 --nproc 3 --zero 2 --metrics z.csv \
  --save-model zero2 2>zero2.log || fail "--zero 2:\n$(cat zero2.log)"
"$STREAMBP" compare single/model.safetensors zero2/model.safetensors --rtol 1e-12 >cmpz.txt ||
  fail "--zero 2 differs from one process:\n$(cat cmpz.txt)"
python3 - z.csv <<'PY' || fail "metrics of --zero 2:\n$(cat z.csv)"
import csv, sys
for r in csv.DictReader(open(sys.argv[1])):
    # 4 groups reduce-scattered and gathered; all-reduced: the totals, the loss, the gradient norm
    assert (r["zero"], r["reduce_scatter_calls"], r["all_gather_calls"], r["all_reduce_calls"]) == ("2", "4", "4", "3"), r
PY
echo "ok: --nproc 3 --zero 2 equals one process: $(tail -1 cmpz.txt)"
# ZeRO-3 over 2 ranks on GRPO (the random batch's log-probs computed by the whole, gathered model): each layer
# gathered for its forward and again for its backward chunk loop, the embedding and head once per step.
grpo=(--objective grpo:beta=0.04 --group 3)
"$STREAMBP" train "${common[@]}" "${grpo[@]}" --method standard --save-model grpo1 2>grpo1.log ||
  fail "GRPO, single process:\n$(cat grpo1.log)"
"$STREAMBP" train "${common[@]}" "${grpo[@]}" --method streambp:layer_chunk=16,head_chunk=8 --nproc 2 --zero 3 \
  --metrics z3.csv --save-model zero3 2>zero3.log || fail "--zero 3:\n$(cat zero3.log)"
"$STREAMBP" compare grpo1/model.safetensors zero3/model.safetensors --rtol 1e-12 >cmpz3.txt ||
  fail "GRPO --zero 3 differs from one process:\n$(cat cmpz3.txt)"
python3 - z3.csv <<'PY' || fail "metrics of --zero 3:\n$(cat z3.csv)"
import csv, sys
for r in csv.DictReader(open(sys.argv[1])):
    # 2 layers x (forward + backward) + the embedding and head: 5 all-gathers; 4 groups reduce-scattered
    assert (r["zero"], r["reduce_scatter_calls"], r["all_gather_calls"], r["all_reduce_calls"]) == ("3", "4", "5", "3"), r
PY
echo "ok: GRPO --nproc 2 --zero 3 equals one process: $(tail -1 cmpz3.txt)"
# Checkpoints do not depend on the world size or stage: ZeRO-2 over 3 ranks writes what one process writes (the
# optimizer's slices gathered into whole tensors), and one process's checkpoint resumes on 2 ranks under ZeRO-3.
"$STREAMBP" train "${common[@]}" --method standard --save-every 2 --checkpoint-dir ckpt1 2>ckpt1.log ||
  fail "single process with checkpoints:\n$(cat ckpt1.log)"
"$STREAMBP" train "${common[@]}" --method streambp --nproc 3 --zero 2 --save-every 2 --checkpoint-dir ckptz \
  2>ckptz.log || fail "--zero 2 with checkpoints:\n$(cat ckptz.log)"
for f in trainable optimizer; do
  "$STREAMBP" compare ckpt1/checkpoint-000002/$f.safetensors ckptz/checkpoint-000002/$f.safetensors --rtol 1e-12 \
    >cmpc.txt || fail "the ZeRO-2 checkpoint's $f.safetensors differs:\n$(cat cmpc.txt)"
done
mkdir resumed && cp -r ckpt1/checkpoint-000002 resumed/
"$STREAMBP" train "${common[@]}" --method streambp --nproc 2 --zero 3 --resume resumed --save-model resumed3 \
  2>resumed3.log || fail "--zero 3 --resume:\n$(cat resumed3.log)"
grep -q "resume    resumed/checkpoint-000002 (step 2)" resumed3.log || fail "not resumed:\n$(cat resumed3.log)"
"$STREAMBP" compare single/model.safetensors resumed3/model.safetensors --rtol 1e-12 >cmpr.txt ||
  fail "one process's checkpoint resumed under ZeRO-3 differs:\n$(cat cmpr.txt)"
echo "ok: ZeRO checkpoints equal one process's and resume on another world size: $(tail -1 cmpr.txt)"

# Drivers (Tables 4-5): `maxlen --nproc 2 --zero 2` searches T per rank under a per-rank budget (every probe a
# 2-rank training step; the measured T fits, the next step up does not); `sweep seq --nproc 2` times data-parallel
# BP steps of checkpointing and StreamBP at two lengths, a ratio to checkpointing in the same run.
"$STREAMBP" maxlen --preset tiny --budget-bytes 4000000 --methods "checkpoint;streambp:layer_chunk=64,head_chunk=64" \
  --optimizer adamw:lr=1e-3 --batch 2 --nproc 2 --zero 2 --out maxlen >maxlen.txt 2>maxlen.log || fail "maxlen --nproc 2:\n$(cat maxlen.log)"
python3 - maxlen/maxlen-*.csv <<'PY' || fail "maxlen --nproc 2 CSV:\n$(cat maxlen/maxlen-*.csv)"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
assert rows and all((r["world_size"], r["zero"]) == ("2", "2") for r in rows), rows
for method in {r["method"] for r in rows}:
    mine = [r for r in rows if r["method"] == method]
    best = [r for r in mine if r["role"] == "max"]
    nxt = [r for r in mine if r["role"] == "next"]
    assert len(best) == 1 and best[0]["status"] != "oom" and int(best[0]["peak_bytes"]) <= 4000000, mine
    assert len(nxt) == 1 and nxt[0]["status"] == "oom" and int(nxt[0]["seq_len"]) > int(best[0]["seq_len"]), mine
PY
grep -q "B = 2 (1 per rank), 2 ranks (ZeRO-2, Gloo)" maxlen.txt || fail "maxlen does not say its ranks:\n$(cat maxlen.txt)"
echo "ok: maxlen --nproc 2 --zero 2: $(grep -c 'measured T\*' maxlen.txt) methods searched"
# --model-only answers for --nproc N --zero S in one process: the T* the ranks' own model gave each method above.
"$STREAMBP" maxlen --preset tiny --budget-bytes 4000000 --methods "checkpoint;streambp:layer_chunk=64,head_chunk=64" \
  --optimizer adamw:lr=1e-3 --batch 2 --nproc 2 --zero 2 --model-only >model_only.txt 2>&1 ||
  fail "maxlen --model-only --nproc 2 --zero 2:\n$(cat model_only.txt)"
python3 - maxlen/maxlen-*.csv model_only.txt <<'PY' || fail "maxlen --model-only --nproc 2 --zero 2:\n$(cat model_only.txt)"
import csv, re, sys
ranks = {r["method"]: r["model_max_seq"] for r in csv.DictReader(open(sys.argv[1]))}
alone = dict(re.findall(r"^(\S+): the model predicts T\* = (\d+) ", open(sys.argv[2]).read(), re.M))
assert alone == ranks, (alone, ranks)
print("ok: maxlen --model-only --nproc 2 --zero 2 predicts the ranks' T*:", alone)
PY
expect_exit_2 "maxlen --model-only --zero without --nproc" "--zero 2 shards across data-parallel ranks" \
  "$STREAMBP" maxlen --preset tiny --budget-bytes 4000000 --optimizer adamw --zero 2 --model-only
"$STREAMBP" sweep seq --preset tiny --seq 128,256 --methods "checkpoint;streambp:layer_chunk=64,head_chunk=64" \
  --batch 2 --nproc 2 --zero 2 --repeats 1 --check-seq 40 --out sweep >sweep.txt 2>sweep.log || fail "sweep --nproc 2:\n$(cat sweep.log)"
python3 - sweep/seq-*.csv <<'PY' || fail "sweep --nproc 2 CSV:\n$(cat sweep/seq-*.csv)"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
assert len(rows) == 4 and all((r["world_size"], r["zero"], r["status"]) == ("2", "2", "passed") for r in rows), rows
for r in rows:
    assert float(r["time_vs_checkpoint"]) > 0 and float(r["bp_seconds"]) > 0, r
    # per row of the global batch (--batch 2: 1 row per rank)
    assert abs(float(r["seconds_per_sample"]) - float(r["bp_seconds"]) / 2) < 1e-3, r
PY
echo "ok: sweep seq --nproc 2 --zero 2"
expect_exit_2 "maxlen --nproc without --optimizer" "give --optimizer" "$STREAMBP" maxlen --preset tiny \
  --budget-bytes 4000000 --batch 2 --nproc 2
# --batch is the global batch in every command: rows that do not split over the ranks are refused before any rank
# starts, with sizes that would.
expect_exit_2 "maxlen --batch 3 --nproc 2" "3 rows, which do not split evenly over 2 ranks.*2 or 4 rows would" \
  "$STREAMBP" maxlen --preset tiny --budget-bytes 4000000 --optimizer adamw --batch 3 --nproc 2
expect_exit_2 "sweep --batch 1,3 --nproc 2" "1 row, which do not split evenly over 2 ranks" \
  "$STREAMBP" sweep seq --preset tiny --seq 64 --batch 1,3 --nproc 2

# (b) One rank disturbed mid-run: `disturb NPROC SIGNAL LOG [train flags]` starts NPROC ranks of a long run, waits
# for the first step, sends SIGNAL to rank 1 and waits for the launcher; it must exit non-zero (not by a signal),
# naming a rank, with no rank left running. Sets $elapsed (seconds from the signal to the launcher's exit).
long=(--preset tiny --dtype fp32 --batch 6 --seq 1024 --steps 1000 --method streambp:layer_chunk=128,head_chunk=128)
disturb() {
  local nproc=$1 signal=$2 log=$3 launcher victim="" status=0 start
  shift 3
  "$STREAMBP" train "${long[@]}" --nproc "$nproc" "$@" 2>"$log" &
  launcher=$!
  for _ in $(seq 1 100); do
    mapfile -t kids < <(pgrep -P $launcher || true)
    [[ ${#kids[@]} -eq $nproc ]] && grep -q "^step 1/" "$log" && { victim=${kids[1]}; break; }
    sleep 0.2
  done
  [[ -n $victim ]] || { kill -9 $launcher 2>/dev/null; fail "the ranks never started:\n$(cat "$log")"; }
  kill -"$signal" "$victim"
  start=$(date +%s)
  wait $launcher || status=$?
  elapsed=$(($(date +%s) - start))
  [[ $status -ne 0 && $status -lt 128 ]] || fail "launcher exit $status after SIG$signal to a rank:\n$(cat "$log")"
  grep -qE "streambp: rank [0-9] of $nproc " "$log" || fail "no rank named:\n$(cat "$log")"
  [[ -z $(pgrep -P $launcher || true) ]] || fail "ranks left running"
}
# SIGKILL: the survivors' collectives fail at once.
disturb 3 KILL kill.log --dist-timeout 30
grep -qE "streambp: rank [0-9] of 3 was killed by signal 9" kill.log || fail "the dead rank is not named:\n$(cat kill.log)"
[[ $elapsed -le 40 ]] || fail "the survivors took ${elapsed} s to stop"
echo "ok: a killed rank stops the run in ${elapsed} s: $(grep -m1 'streambp: rank' kill.log)"
# SIGSTOP: the others give up after --dist-timeout, the launcher SIGKILLs the stalled one after its grace period.
disturb 2 STOP stop.log --dist-timeout 5
[[ $elapsed -le 60 ]] || fail "a stalled rank held the run for ${elapsed} s"
echo "ok: a stalled rank stops the run in ${elapsed} s: $(grep -m1 'streambp: rank' stop.log)"

# Ctrl-C from a terminal reaches the launcher and every rank (one process group): the ranks agree to stop after the
# same step, rank 0 writes that step's checkpoint, the launcher relays the resume command and exits 130.
setsid "$STREAMBP" train "${long[@]}" --nproc 2 --checkpoint-dir ctrlc --save-every 1000 2>ctrlc.log &
group=$!
for _ in $(seq 1 300); do grep -q "^step 1/" ctrlc.log && break; sleep 0.2; done
grep -q "^step 1/" ctrlc.log || { kill -9 -- -"$group"; fail "Ctrl-C on 2 ranks: no step in 60 s:\n$(cat ctrlc.log)"; }
kill -INT -- -"$group"
status=0
wait "$group" || status=$?
[[ $status -eq 130 ]] || fail "Ctrl-C on 2 ranks: exit $status, expected 130:\n$(cat ctrlc.log)"
step=$(sed -n 's/^stopped   after step \([0-9]*\) of 1000 (Ctrl-C); resume with:$/\1/p' ctrlc.log)
[[ -n $step ]] || fail "Ctrl-C on 2 ranks: no resume line:\n$(cat ctrlc.log)"
[[ -f ctrlc/$(printf 'checkpoint-%06d' "$step")/trainer.json ]] || fail "no checkpoint of step $step:\n$(ls -R ctrlc)"
grep -q -- "--resume ctrlc" ctrlc.log || fail "the resume command does not name ctrlc:\n$(cat ctrlc.log)"
echo "ok: Ctrl-C on 2 ranks stopped both after step $step with its checkpoint, exit 130"

# (c) Ranks that disagree, started by hand as the launcher starts them.
small=(--preset tiny --batch 2 --seq 16 --steps 1 --method standard --dist-timeout 30)
expect_ranks_disagree "ranks with different seeds" "disagree on seed" --seed 0 1 "${small[@]}"
# Refused once, before any rank starts, with the sizes that would split.
expect_exit_2 "rows that do not split over the ranks" \
  "^streambp: error: --nproc 3: the global batch \\(--batch 4\\) has 4 rows, which do not split evenly over 3 ranks \\(each rank takes rows / 3\\); 3 or 6 rows would$" \
  "$STREAMBP" train --preset tiny --batch 4 --seq 16 --steps 1 --method standard --nproc 3
[[ $("$STREAMBP" train --preset tiny --batch 4 --seq 16 --steps 1 --method standard --nproc 3 2>&1 | grep -c "do not split") -eq 1 ]] ||
  fail "the uneven batch is refused more than once"
