# Malformed input exits non-zero with a message that says what is wrong (STYLE rule 7).
# ctest-cost: 30
source "$(dirname "$0")/../support/cli_common.sh"

"$STREAMBP" run --preset tiny --method standard --seq 8 --save-model "$WORK/M" --save-grads g.safetensors >/dev/null
# A weights file cut in the middle of its data, as an interrupted copy leaves it: the message names the file.
weights="$WORK/M/model.safetensors"
truncate -s $(($(stat -c %s "$weights") / 2)) "$weights"
expect_failure "truncated model.safetensors" "$weights" \
  "$STREAMBP" run --load "$WORK/M" --method standard --seq 8

expect_failure "unknown dtype" "fp8" "$STREAMBP" run --preset tiny --method standard --seq 8 --dtype fp8
# CLI11's own rejections are bad input too: exit 2, not its codes 105-113.
expect_exit_2 "a value outside its set" "fp8" "$STREAMBP" run --preset tiny --method standard --seq 8 --dtype fp8
expect_exit_2 "an unknown flag" "--no-such-flag" "$STREAMBP" run --preset tiny --method standard --seq 8 --no-such-flag
expect_exit_2 "a flag value of the wrong type" "--seq: 'eight' is not a whole number \\(expected one in \\[2, 2\\^40\\]\\)" \
  "$STREAMBP" run --preset tiny --method standard --seq eight
expect_exit_2 "a flag value out of range" "--seq: -5 is outside \\[2, 2\\^40\\]" "$STREAMBP" run --preset tiny --method standard --seq -5
expect_exit_2 "a required option missing" "--method" "$STREAMBP" run --preset tiny --seq 8
"$STREAMBP" run --help >/dev/null || fail "run --help must exit 0"
# `sweep KIND --help` shows that kind's defaults (not the same text for every kind), `sweep --help` every kind's.
"$STREAMBP" sweep batch --help >help-batch.txt || fail "sweep batch --help must exit 0"
grep -q "sweep batch      --seq 2048  --batch 1,2,4" help-batch.txt || fail "sweep batch --help hides its defaults:\n$(tail -4 help-batch.txt)"
! grep -q "sweep seq " help-batch.txt || fail "sweep batch --help shows seq's defaults:\n$(tail -4 help-batch.txt)"
"$STREAMBP" sweep --help >help-sweep.txt || fail "sweep --help must exit 0"
[[ $(grep -c "^  sweep " help-sweep.txt) == 3 ]] || fail "sweep --help does not show every kind's defaults"
grep -q -- "--repeats INT:POSITIVE=2" help-sweep.txt || fail "sweep --help hides --repeats' default"
expect_exit_2 "a mistyped method before a missing --seq" "unknown method 'nonsense'" \
  "$STREAMBP" run --preset tiny --method nonsense
expect_exit_2 "an output in a folder that does not exist" "--save-grads /nonexistent/x.safetensors: the folder /nonexistent does not exist" \
  "$STREAMBP" run --preset tiny --method standard --seq 8 --save-grads /nonexistent/x.safetensors
expect_exit_2 "a mistyped command" "unknown command 'rnu' \\(did you mean run\\?\\)" "$STREAMBP" rnu --seq 8
expect_exit_2 "--zero without ranks" "--zero 2 shards across data-parallel ranks" \
  "$STREAMBP" train --preset tiny --method standard --seq 8 --steps 1 --optimizer adamw:lr=1e-3 --zero 2
# Mixed precision is bf16 (or fp16) compute with fp32 gradients; anything else is refused, naming both flags.
expect_failure "--grad-dtype with fp64" "--grad-dtype fp32 with --dtype fp64" \
  "$STREAMBP" run --preset tiny --method standard --seq 8 --dtype fp64 --grad-dtype fp32
expect_failure "--grad-dtype narrower than --dtype" "--grad-dtype bf16 with --dtype fp32" \
  "$STREAMBP" run --preset tiny --method standard --seq 8 --dtype fp32 --grad-dtype bf16
expect_failure "unknown method" "unknown method 'nosuch'" "$STREAMBP" run --preset tiny --method nosuch --seq 8
expect_failure "unknown method option" "unknown option 'chunk'" \
  "$STREAMBP" run --preset tiny --method streambp:chunk=4 --seq 8
expect_failure "chunk below 1" "layer_chunk=0" \
  "$STREAMBP" run --preset tiny --method streambp:layer_chunk=0 --seq 8
# Found by fuzz_spec (tests/fuzz/regressions/spec): a rank beyond int64 was converted (undefined behaviour).
expect_failure "LoRA rank beyond int64" "rank=1e30 must be an integer in \[1, 2\^53\]" \
  "$STREAMBP" run --preset tiny --method standard --seq 8 --lora rank=1e30
expect_failure "unknown preset" "unknown preset 'nosuch'" "$STREAMBP" run --preset nosuch --method standard --seq 8
expect_failure "no sequence length" "--seq" "$STREAMBP" run --preset tiny --method standard
expect_failure "missing gradient file" "nosuch.safetensors" "$STREAMBP" compare g.safetensors nosuch.safetensors
# Results are never overwritten silently.
expect_failure "existing --save-grads" "g.safetensors" \
  "$STREAMBP" run --preset tiny --method standard --seq 8 --save-grads g.safetensors

# Issue #44. A mistyped flag gets the nearest one, in every command, as a mistyped command does.
expect_exit_2 "a mistyped flag of run" "unknown option '--presett' \\(did you mean --preset\\?\\) for run" \
  "$STREAMBP" run --presett tiny --method standard --seq 8
expect_exit_2 "a mistyped flag of train" "unknown option '--stpes' \\(did you mean --steps\\?\\) for train" \
  "$STREAMBP" train --preset tiny --method standard --seq 8 --stpes=2
expect_exit_2 "a mistyped flag of sweep" "unknown option '--repeat' \\(did you mean --repeats\\?\\) for sweep" \
  "$STREAMBP" sweep seq --preset tiny --repeat 1
# --methods separates specs with ';': a comma-separated list is shown as it should be written.
expect_exit_2 "--methods with commas" "--methods separates specs with ';': --methods \"checkpoint;streambp:layer_chunk=8\"" \
  "$STREAMBP" demo --preset tiny --methods checkpoint,streambp:layer_chunk=8 --seq 16
# An output that cannot be created is refused before any work, naming its flag.
expect_exit_2 "--out where no folder can be made" "--out: /proc/nope: cannot create anything in /proc" \
  "$STREAMBP" demo --preset tiny --seq 16 --out /proc/nope
expect_exit_2 "--save-model where no folder can be made" "--save-model /proc/nope: cannot create anything in /proc" \
  "$STREAMBP" run --preset tiny --method standard --seq 8 --save-model /proc/nope
expect_exit_2 "--json in a folder that takes no file" "--json /proc/nope.json: cannot create anything in /proc" \
  "$STREAMBP" train --preset tiny --method standard --seq 8 --json /proc/nope.json
expect_exit_2 "--checkpoint-dir where no folder can be made" "--checkpoint-dir /proc/nope: cannot create anything in /proc" \
  "$STREAMBP" train --preset tiny --method standard --seq 8 --checkpoint-dir /proc/nope --save-every 1
# Two outputs on one path, the metrics' sidecar included, are refused before any work (nothing is written).
expect_exit_2 "--json on the metrics' sidecar" "--json run.json and --metrics \\(its .json sidecar\\) run.json are one path" \
  "$STREAMBP" train --preset tiny --method standard --seq 8 --metrics run.csv --json run.json
expect_exit_2 "--metrics named .json" "--metrics m.json and --metrics \\(its .json sidecar\\) m.json are one path" \
  "$STREAMBP" train --preset tiny --method standard --seq 8 --metrics m.json
expect_exit_2 "--save-model on the checkpoint folder" "--save-model c and --checkpoint-dir ./c are one path" \
  "$STREAMBP" train --preset tiny --method standard --seq 8 --save-model c --checkpoint-dir ./c --save-every 1
# train's micro-batches by rows and its gradients: what they cannot mean is refused before any rank starts.
expect_exit_2 "--micro-batches not a row list" "--micro-batches 0;1,x: 'x' is not a row index" \
  "$STREAMBP" train --preset tiny --method standard --seq 8 --batch 3 --micro-batches "0;1,x"
expect_exit_2 "--micro-batches leaving a row out" "random batch of step 1, --micro-batches: micro_batches: row 2 is in no micro-batch" \
  "$STREAMBP" train --preset tiny --method standard --seq 8 --batch 3 --micro-batches "0;1"
expect_exit_2 "--micro-batches over data-parallel groups" "--micro-batches names rows of one batch: 2 data-parallel groups" \
  "$STREAMBP" train --preset tiny --method standard --seq 8 --batch 4 --nproc 2 --micro-batches "0,1;2,3"
expect_exit_2 "--save-grads under ZeRO-2" "--save-grads needs whole gradients on rank 0: --zero 0 or 1" \
  "$STREAMBP" train --preset tiny --method standard --seq 8 --batch 2 --nproc 2 --zero 2 --save-grads g
expect_exit_2 "two outputs of run on one path" "--save-grads x and --save-batch sub/../x are one path" \
  "$STREAMBP" run --preset tiny --method standard --seq 8 --save-grads x --save-batch sub/../x
expect_exit_2 "--timeline on --op-profile" "--timeline t.csv and --op-profile t.csv are one path" \
  "$STREAMBP" run --preset tiny --method standard --seq 8 --timeline t --op-profile t.csv
# rl-step (docs/rl-steps.md): a bad case is refused naming the file and the key or the row, before anything is written.
"$STREAMBP" run --preset tiny --method standard --seq 8 --save-model "$WORK/R" >/dev/null
echo '{"prompts": [[5]], "completions": [[1], [6, 1]], "rewards": [[1], [0]], "settings": {"lr": 0.1}}' >"$WORK/bad_key.json"
expect_exit_2 "an unknown RL step setting" "bad_key.json: unknown setting 'lr'" \
  "$STREAMBP" rl-step --load "$WORK/R" --case "$WORK/bad_key.json" --out r.safetensors
echo '{"prompts": [[5]], "completions": [[1], [6, 7]], "rewards": [[1], [0]],
       "settings": {"max_completion_length": 3, "per_device_train_batch_size": 2}}' >"$WORK/bad_row.json"
expect_exit_2 "a completion without EOS shorter than max_completion_length" "completions\\[1\\] has no EOS" \
  "$STREAMBP" rl-step --load "$WORK/R" --case "$WORK/bad_row.json" --out r.safetensors
[[ ! -e run.csv && ! -e run.json && ! -e c && ! -e x && ! -e r.safetensors ]] || fail "a refused command wrote: $(ls)"
