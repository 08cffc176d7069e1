# `streambp train` survives SIGKILL at any moment and resumes bitwise (tiny, bf16, 6 steps of AdamW with a cosine
# schedule and clipping, one seeded random batch per step):
# (a) an uninterrupted run with a checkpoint after every step (--save-every 1) and --save-model;
# (b) the same run started and killed with `kill -9` at random moments, first before its first checkpoint exists,
#     then at least three more times while resumed (`--resume C`, from step 0 when C has no checkpoint), then resumed
#     until done with --save-model. After every kill C holds only complete checkpoint directories (checkpoint-NNNNNN
#     with exactly trainer.json, trainable.safetensors and optimizer.safetensors, both files byte-identical to (a)'s
#     checkpoint of that step) and possibly `.tmp-*` leftovers. Before the last resume a decoy `.tmp-*` directory
#     (a trainer.json of step 6, garbage tensors) and a checkpoint directory without trainer.json are planted: the
#     resume must name the latest real checkpoint. The final model.safetensors is byte-identical (cmp) to (a)'s, and
#     the resumed run's metrics CSV has steps 1..6 each once with the text of (a)'s step, loss, grad_norm, lr and
#     tokens columns;
# (c) bad input exits 2 naming what is wrong: --resume with another --seed or --optimizer (the key named), --grad-accum
#     3 with --batch 4 (the rows named), --data on an empty folder.
# The kill moments are random fractions of the measured runtime of (a); STREAMBP_KILL_SEED=N replays a draw.
# ctest-cost: 40
source "$(dirname "$0")/../support/cli_common.sh"

kill_seed=${STREAMBP_KILL_SEED:-$(($(date +%s%N) / 1000 % 32768))}
RANDOM=$kill_seed
echo "kill moments drawn with STREAMBP_KILL_SEED=$kill_seed"

# --seq 2048 --batch 2: about 0.2 s a step on 2 cores, so a kill lands inside a step, not only in the startup.
model=(--preset tiny --dtype bf16 --method standard --seq 2048 --batch 2 --steps 6 --lr-schedule cosine,warmup=2
       --clip-grad-norm 1)
seed=(--seed 4)
optimizer=(--optimizer adamw:lr=1e-3,weight_decay=0.1)
args=("${model[@]}" "${seed[@]}" "${optimizer[@]}")

now() { date +%s.%N; }
# (a) --------------------------------------------------------------------------------------------------------------
start=$(now)
"$STREAMBP" train "${args[@]}" --save-every 1 --checkpoint-dir A-ckpt --metrics a.csv --save-model A 2>a.log ||
  fail "uninterrupted run failed:\n$(cat a.log)"
total=$(awk -v s="$start" -v e="$(now)" 'BEGIN { print e - s }')
# The steps' own seconds from the metrics; the rest is startup (model, first batch) and writing.
compute=$(awk -F, 'NR > 1 { s += $6 + $7 } END { print s }' a.csv)
startup=$(awk -v t="$total" -v c="$compute" 'BEGIN { print t - c }')
per_step=$(awk -v c="$compute" 'BEGIN { print c / 6 }')
echo "uninterrupted: ${total} s (startup and writing ${startup} s, ${per_step} s a step)"
[[ $(cut -d, -f1 a.csv | tail -n +2 | tr '\n' ' ') == "1 2 3 4 5 6 " ]] || fail "a.csv steps:\n$(cat a.csv)"
# The run says what its data is and ends with a summary naming every output.
grep -q "^data      random batches (no --data)" a.log || fail "no word on random batches:\n$(cat a.log)"
grep -qE "^done      steps 1\.\.6 in [0-9.]+ s \([0-9]+ tokens/s over the run\); loss [0-9.e+-]+ at step 1, [0-9.e+-]+ at step 6$" a.log ||
  fail "no end summary:\n$(tail -3 a.log)"
grep -qx "outputs   model A; metrics a.csv; checkpoints A-ckpt" a.log || fail "outputs not named:\n$(tail -2 a.log)"

# check_checkpoints DIR: DIR holds only complete checkpoints equal to (a)'s and .tmp-* leftovers; sets LATEST (0: none).
check_checkpoints() {
  local dir=$1 entry name step files
  LATEST=0
  [[ -e $dir ]] || return 0
  shopt -s nullglob dotglob
  for entry in "$dir"/*; do
    name=$(basename "$entry")
    if [[ $name == .tmp-* ]]; then
      continue  # a checkpoint being written when the process died: allowed, never read
    elif [[ $name =~ ^checkpoint-([0-9]{6})$ && -d $entry ]]; then
      step=$((10#${BASH_REMATCH[1]}))
      files=$(cd "$entry" && ls -A | tr '\n' ' ')
      [[ $files == "optimizer.safetensors trainable.safetensors trainer.json " ]] ||
        fail "$entry is incomplete or has extra files: $files"
      grep -q "\"step\": $step," "$entry/trainer.json" || fail "$entry/trainer.json is not of step $step"
      for f in trainable.safetensors optimizer.safetensors; do
        cmp -s "$entry/$f" "A-ckpt/$name/$f" || fail "$entry/$f differs from the uninterrupted run's"
      done
      ((step > LATEST)) && LATEST=$step
    else
      fail "unexpected entry $entry in the checkpoint folder"
    fi
  done
  shopt -u nullglob dotglob
}
check_checkpoints A-ckpt
[[ $LATEST -eq 6 ]] || fail "the uninterrupted run left checkpoints up to $LATEST, not 6"

# resumable_run: the run to kill, in the background (PID), resuming from C (from step 0 when C has no checkpoint), or
# a fresh run checkpointing into C when no run got as far as creating C (--resume refuses a folder that does not exist).
resumable_run() {
  local from=(--resume C)
  [[ -d C ]] || from=(--checkpoint-dir C)
  "$STREAMBP" train "${args[@]}" --save-every 1 "${from[@]}" --metrics b.csv 2>>b.log &
  PID=$!
}
# kill_now: SIGKILL the run; sets STATUS (137: killed, 0: it had finished) and checks C.
kill_now() {
  kill -9 "$PID" 2>/dev/null || true
  STATUS=0
  wait "$PID" 2>/dev/null || STATUS=$?  # (bash's "Killed" notice silenced)
  [[ $STATUS -eq 0 || $STATUS -eq 137 ]] || fail "the resumable run exited $STATUS before the kill:\n$(cat b.log)"
  check_checkpoints C
  LEFTOVERS=$(ls -A C 2>/dev/null | grep -c '^\.tmp-' || true)
}
# uniform DELAY in [LOW, HIGH) seconds
draw() { awk -v lo="$1" -v hi="$2" -v r="$RANDOM" 'BEGIN { printf "%.3f", lo + (hi - lo) * r / 32768 }'; }
times() { awk -v a="$1" -v b="$2" 'BEGIN { print a * b }'; }

# (b) --------------------------------------------------------------------------------------------------------------
# Kill 1, before the first checkpoint: inside the startup (again, earlier, if the machine was faster than measured).
limit=$startup
for attempt in 1 2 3 4 5; do
  delay=$(draw "$(times "$limit" 0.2)" "$limit")
  resumable_run
  sleep "$delay"
  kill_now
  [[ $STATUS -eq 137 && $LATEST -eq 0 ]] && break
  echo "a kill after $delay s came after the first checkpoint (exit $STATUS, latest $LATEST): again, earlier"
  rm -rf C b.csv b.json b.log  # b.json: the metrics sidecar, else the next fresh run refuses to overwrite it
  limit=$(times "$limit" 0.5)
done
[[ $STATUS -eq 137 && $LATEST -eq 0 ]] || fail "could not kill the run before its first checkpoint"
echo "kill 1 after $delay s: no checkpoint yet ($LEFTOVERS .tmp-* leftovers)"

# Kills 2-4, inside the training: the resumed run is left to write its next checkpoint (at most checkpoint 3: one
# that exists already kills it in its startup), then killed a random fraction of a step later - in the next step or
# while it writes its checkpoint; 0.8 of a step, so that a machine up to twice as fast as measured still leaves the
# final resume steps to run.
kills=1
while ((kills < 4)); do
  before=$LATEST
  target=$((before + 1))
  ((target > 3)) && target=3
  resumable_run
  waited=0
  until [[ -d C/checkpoint-$(printf %06d "$target") ]] || ! kill -0 "$PID" 2>/dev/null; do
    sleep 0.02
    waited=$((waited + 1))
    ((waited < 3000)) || fail "no checkpoint $target after 60 s"
  done
  delay=$(draw 0 "$(times "$per_step" 0.8)")
  sleep "$delay"
  kill_now
  ((STATUS == 137)) || fail "the run resumed at step $before ended before its kill (exit $STATUS):\n$(cat b.log)"
  kills=$((kills + 1))
  echo "kill $kills $delay s after checkpoint $target (resumed at step $before): complete checkpoints up to step" \
       "$LATEST ($LEFTOVERS .tmp-* leftovers)"
done
((kills >= 4)) || fail "only $kills kills (need 4: one before the first checkpoint, three inside the training)"

# Kill 5, while a resumed run loads its checkpoint: inside the startup.
delay=$(draw "$(times "$startup" 0.1)" "$(times "$startup" 0.9)")
before=$LATEST
resumable_run
sleep "$delay"
kill_now
((STATUS == 137)) || fail "the run resumed at step $before ended before its kill (exit $STATUS):\n$(cat b.log)"
echo "kill 5 after $delay s (resumed at step $before): complete checkpoints up to step $LATEST" \
     "($LEFTOVERS .tmp-* leftovers)"

# Decoys the resume must never pick: a temporary directory that looks complete, a checkpoint without trainer.json,
# and one whose step does not fit int64 (not one `train` writes; it once ended the resume with stoll's out_of_range).
big=C/checkpoint-99999999999999999999
mkdir -p C/.tmp-checkpoint-000006-1 C/checkpoint-000099 "$big"
printf '{"step": 6, "run": {}}\n' >C/.tmp-checkpoint-000006-1/trainer.json
printf '{"step": 7, "run": {}}\n' >"$big/trainer.json"
for d in C/.tmp-checkpoint-000006-1 C/checkpoint-000099 "$big"; do
  echo garbage >"$d/trainable.safetensors"
  echo garbage >"$d/optimizer.safetensors"
done
"$STREAMBP" train "${args[@]}" --save-every 1 --resume C --metrics b.csv --save-model B 2>final.log ||
  fail "the final resume failed:\n$(cat final.log)"
if ((LATEST > 0)); then
  grep -qF "resume    C/checkpoint-$(printf %06d "$LATEST") (step $LATEST)" final.log ||
    fail "the final resume did not continue from checkpoint $LATEST:\n$(cat final.log)"
fi
echo "final resume from step $LATEST: $(grep -c '^step ' final.log || true) step(s) run"
rm -rf C/.tmp-checkpoint-000006-1 C/checkpoint-000099 "$big"
check_checkpoints C
[[ $LATEST -eq 6 ]] || fail "the resumed run left checkpoints up to $LATEST, not 6"

cmp A/model.safetensors B/model.safetensors || fail "the resumed model differs from the uninterrupted one"
cmp A/config.json B/config.json || fail "the resumed model's config.json differs"
echo "ok: model.safetensors of the killed and resumed run is byte-identical to the uninterrupted run's"
[[ $(cut -d, -f1 b.csv | tail -n +2 | tr '\n' ' ') == "1 2 3 4 5 6 " ]] ||
  fail "the resumed metrics do not hold steps 1..6 once each:\n$(cat b.csv)"
diff <(cut -d, -f1-5 a.csv) <(cut -d, -f1-5 b.csv) >/dev/null ||
  fail "the resumed metrics differ from the uninterrupted run's:\n$(diff <(cut -d, -f1-5 a.csv) <(cut -d, -f1-5 b.csv))"
echo "ok: metrics steps 1..6 once each, step/loss/grad_norm/lr/tokens text equal to the uninterrupted run's"

# Ctrl-C (SIGINT) in the middle: the step in progress finishes, a checkpoint of it is written (equal to (a)'s), the
# run prints the command that resumes it and exits 130; that command finishes the run byte-identical to (a).
"$STREAMBP" train "${args[@]}" --save-every 3 --checkpoint-dir I-ckpt --save-model I >i.log 2>&1 &
pid=$!
ctrl_c $pid i.log
status=0
wait $pid || status=$?
[[ $status -eq 130 ]] || fail "Ctrl-C: exit $status, expected 130:\n$(cat i.log)"
stopped=$(sed -n 's/^stopped   after step \([1-5]\) of 6 (Ctrl-C); resume with:$/\1/p' i.log)
[[ -n $stopped ]] || fail "Ctrl-C: no 'stopped ... resume with' line:\n$(cat i.log)"
ckpt=$(printf 'checkpoint-%06d' "$stopped")
for f in trainable.safetensors optimizer.safetensors; do
  cmp -s "I-ckpt/$ckpt/$f" "A-ckpt/$ckpt/$f" || fail "Ctrl-C: $ckpt/$f differs from the uninterrupted run's"
done
[[ ! -e I ]] || fail "Ctrl-C: the final model was written by a stopped run"
resume=$(grep -A1 "^stopped " i.log | tail -1)
[[ $resume == *" --resume I-ckpt"* ]] || fail "Ctrl-C: the resume command does not resume from I-ckpt: $resume"
eval "$resume" >i2.log 2>&1 || fail "the printed resume command failed:\n$resume\n$(cat i2.log)"
cmp A/model.safetensors I/model.safetensors || fail "Ctrl-C then the printed command: the model differs from (a)'s"
echo "ok: Ctrl-C after step $stopped wrote $ckpt, exited 130, and '$resume' finished the run bitwise"

# (c) --------------------------------------------------------------------------------------------------------------
# P: C without its last checkpoint, a run with a step still to take (a finished run has nothing to do: (d)).
cp -r C P && rm -r "$(ls -d P/checkpoint-* | sort | tail -1)"
expect_exit_2 "--resume with another --seed" "checkpoint's seed is 4, this run's 5" \
  "$STREAMBP" train "${model[@]}" --seed 5 "${optimizer[@]}" --resume P
expect_exit_2 "--resume with another --optimizer" "checkpoint's optimizer is .*lr=0.001.*this run's .*lr=0.002" \
  "$STREAMBP" train "${model[@]}" "${seed[@]}" --optimizer adamw:lr=2e-3,weight_decay=0.1 --resume P
expect_exit_2 "--grad-accum 3 with --batch 4" "random batch of step 1: 4 rows do not split into 3" \
  "$STREAMBP" train --preset tiny --method standard --seq 16 --batch 4 --steps 1 --grad-accum 3
# Found by fuzz_train_resume (tests/fuzz/regressions/train_resume): a trainer.json without "step" ended the resume
# with nlohmann's "key 'step' not found", a metrics row led by no number with a bare "stoll"; each names its file now.
cp -r P D
latest=$(ls -d D/checkpoint-* | sort | tail -1)
printf '{"run": {}}\n' >"$latest/trainer.json"
expect_failure "--resume from a trainer.json without its step" "$latest/trainer.json: not a trainer.json of .train." \
  "$STREAMBP" train "${model[@]}" "${seed[@]}" "${optimizer[@]}" --resume D
cp -r P E && { head -1 b.csv; echo "x,1"; } >e.csv
expect_failure "--resume onto a metrics file with a row of no step" "--metrics e.csv: line 2: step 'x' is not an integer" \
  "$STREAMBP" train "${model[@]}" "${seed[@]}" "${optimizer[@]}" --resume E --metrics e.csv
# A checkpoint whose bf16 GEMM paths are not this machine's (written on another CPU): kept, and said.
cp -r P G
latest=$(ls -d G/checkpoint-* | sort | tail -1)
python3 - "$latest/trainer.json" <<'PY'
import json, sys
meta = json.load(open(sys.argv[1]))
meta["narrow_gemm"] = "nt=native,nn=widened,tn=native"  # mixed: never a machine's default
json.dump(meta, open(sys.argv[1], "w"))
PY
"$STREAMBP" train "${args[@]}" --resume G >g.log 2>&1 || fail "resume with other GEMM paths:\n$(cat g.log)"
grep -q "^note      the checkpoint's bf16 GEMM paths (.*) are kept so that the run continues bitwise" g.log ||
  fail "no note on the checkpoint's GEMM paths:\n$(cat g.log)"
echo "ok: $(grep -m1 '^note ' g.log)"
mkdir empty
expect_exit_2 "--resume from a folder that does not exist" "--resume nosuch: no such folder \\(a mistyped path\\?\\)" \
  "$STREAMBP" train "${model[@]}" "${seed[@]}" "${optimizer[@]}" --resume nosuch
expect_exit_2 "--data on an empty folder" "--data empty: no .safetensors batch files" \
  "$STREAMBP" train --preset tiny --method standard --data empty --steps 1

# (d) --------------------------------------------------------------------------------------------------------------
# A finished run resumed with its own arguments (docs/training.md's recipe after the end): nothing to do, exit 0, its
# outputs untouched. A larger --steps extends a constant-schedule run exactly as a run that long from the start
# (metrics and checkpoint bytes equal); a cosine run refuses, saying why.
short=(--preset tiny --method standard --seq 16 --batch 2 --seed 3 --checkpoint-dir X --save-every 1)
"$STREAMBP" train "${short[@]}" --steps 2 --metrics x.csv --save-model XM >x.log 2>&1 || fail "short run:\n$(cat x.log)"
before=$(cat x.csv XM/model.safetensors | cksum)
"$STREAMBP" train "${short[@]}" --steps 2 --metrics x.csv --save-model XM --resume X >x2.log 2>&1 ||
  fail "resuming a finished run failed:\n$(cat x2.log)"
grep -q "^train     nothing to do: X holds step 2 and --steps is 2" x2.log || fail "no 'nothing to do':\n$(cat x2.log)"
! grep -q "steps 3\.\.2" x2.log || fail "a finished run announced steps 3..2:\n$(cat x2.log)"
[[ $(cat x.csv XM/model.safetensors | cksum) == "$before" ]] || fail "resuming a finished run touched its outputs"
# Changed, it is refused as any resume (exit 2, naming the setting); an output it did not write is written from its
# final checkpoint, the same bytes as the run wrote; a new --metrics is refused (its steps' rows are in x.csv only).
expect_exit_2 "a finished run resumed with another learning rate" "checkpoint's optimizer is .*, this run's .*lr=0.002" \
  "$STREAMBP" train "${short[@]}" --steps 2 --metrics x.csv --save-model XM --optimizer adamw:lr=2e-3 --resume X
"$STREAMBP" train "${short[@]}" --steps 2 --metrics x.csv --save-model XM2 --resume X >x4.log 2>&1 ||
  fail "a finished run asked for a new --save-model:\n$(cat x4.log)"
grep -qx "outputs   model XM2 (of the final checkpoint, step 2)" x4.log || fail "XM2 not named:\n$(cat x4.log)"
cmp XM/model.safetensors XM2/model.safetensors || fail "the model written from the final checkpoint differs"
[[ $(cat x.csv XM/model.safetensors | cksum) == "$before" ]] || fail "writing XM2 touched the run's outputs"
expect_exit_2 "a finished run with a new --metrics" "--metrics new.csv: the run in X is finished \\(step 2, --steps 2\\)" \
  "$STREAMBP" train "${short[@]}" --steps 2 --metrics new.csv --resume X
echo "ok: a finished run refuses a changed learning rate and writes a new --save-model from its final checkpoint"
"$STREAMBP" train "${short[@]}" --steps 4 --metrics x.csv --resume X >x3.log 2>&1 || fail "extending:\n$(cat x3.log)"
grep -q "^extend    the run was written for --steps 2; it trains on to 4" x3.log || fail "no word on extending:\n$(cat x3.log)"
"$STREAMBP" train "${short[@]/X/Y}" --steps 4 --metrics y.csv >y.log 2>&1 || fail "4-step run:\n$(cat y.log)"
diff <(cut -d, -f1-4 x.csv) <(cut -d, -f1-4 y.csv) >/dev/null || fail "extended metrics differ from a 4-step run's:\n$(paste -d'|' x.csv y.csv)"
cmp X/checkpoint-000004/trainable.safetensors Y/checkpoint-000004/trainable.safetensors ||
  fail "the extended run's step-4 weights differ from a 4-step run's"
cmp X/checkpoint-000004/optimizer.safetensors Y/checkpoint-000004/optimizer.safetensors ||
  fail "the extended run's step-4 optimizer state differs from a 4-step run's"
echo "ok: a finished run resumed says nothing to do; --steps 4 extends a 2-step constant run bitwise to a 4-step run"
"$STREAMBP" train "${short[@]/X/Z}" --steps 2 --lr-schedule cosine >z.log 2>&1 || fail "cosine run:\n$(cat z.log)"
expect_exit_2 "extending a cosine run" "the run was written for --steps 2, this one asks 4: the cosine schedule decays over --steps" \
  "$STREAMBP" train "${short[@]/X/Z}" --steps 4 --lr-schedule cosine --resume Z
