# The newcomer's path (issue #44), each step checked by what it promises:
# (1) a demo-sized `run` (tiny, T = 64) finishes and writes its gradients and record;
# (2) `conform` passes with the example adapter a newcomer copies (verify/conform/example_adapter.py) on an SFT case;
# (3) `train` with checkpoints, metrics and a record, stopped by Ctrl-C (SIGINT) in its first step: exit 130 and a
#     printed resume command; that command run verbatim (the printed line through eval) finishes the run, with final
#     weights byte-identical to an uninterrupted run's and the same metrics rows.
# Usage: cli_newcomer.sh BINARY PYTHON
# ctest-needs-python
# ctest-timeout: 300
SRC=$(cd "$(dirname "$0")/../.." && pwd)
source "$SRC/tests/support/cli_common.sh"
PY=$2

# (1) --------------------------------------------------------------------------------------------------------------
"$STREAMBP" run --preset tiny --method streambp:layer_chunk=16,head_chunk=16 --seq 64 --batch 2 \
  --save-grads g.safetensors --json run.json >run.txt 2>&1 || fail "the demo-sized run failed:\n$(cat run.txt)"
[[ -s g.safetensors && -s run.json ]] || fail "the run's outputs are missing: $(ls)"
python3 -c 'import json; s = json.load(open("run.json"))["status"]; assert s == "unchecked", s' ||
  fail "the run's status:\n$(cat run.json)"
echo "ok: run writes its gradients and record"

# (2) --------------------------------------------------------------------------------------------------------------
# One case, quick's first (tiny: GQA, qk-norm, tied head; T = 37, ragged padding, masked prompts), as each case costs
# the adapter's start (torch and transformers); cli_conform_example runs the example on the whole quick matrix.
echo '[{"name": "sft-tiny-T37", "preset": "tiny", "seq": 37, "batch": 3}]' >cases.json
"$STREAMBP" conform --impl "$PY $SRC/verify/conform/example_adapter.py" --cases cases.json --out conform \
  >conform.txt 2>conform.log || fail "the example adapter does not conform:\n$(cat conform.txt conform.log)"
grep -q "^1 of 1 case(s) passed" conform.txt || fail "conform's summary:\n$(cat conform.txt)"
echo "ok: the example adapter: $(grep -E -m1 "case\(s\) passed" conform.txt)"

# (3) --------------------------------------------------------------------------------------------------------------
train=(train --preset tiny --method streambp:layer_chunk=32,head_chunk=32 --seq 128 --batch 2 --steps 6 --seed 5
       --optimizer adamw:lr=1e-3 --lr-schedule cosine,warmup=2)
"$STREAMBP" "${train[@]}" --save-model A --metrics a.csv >a.log 2>&1 || fail "the uninterrupted run failed:\n$(cat a.log)"
# The user's run, with every output. Named run.csv and run.json, the metrics' sidecar (run.json) and the record would be
# one file: refused before any work, rather than found when the printed resume command fails.
expect_exit_2 "the metrics' sidecar on the record" "--json run.json and --metrics \\(its .json sidecar\\) run.json" \
  "$STREAMBP" "${train[@]}" --checkpoint-dir ckpt --save-every 4 --metrics run.csv --json run.json
[[ ! -e ckpt ]] || fail "a refused run made its checkpoint folder"
"$STREAMBP" "${train[@]}" --checkpoint-dir ckpt --save-every 4 --metrics metrics.csv --json record.json --save-model B \
  >b.log 2>&1 &
pid=$!
ctrl_c $pid b.log
status=0
wait $pid || status=$?
[[ $status -eq 130 ]] || fail "Ctrl-C: exit $status, expected 130:\n$(cat b.log)"
stopped=$(sed -n 's/^stopped   after step \([0-9]*\) of 6 (Ctrl-C); resume with:$/\1/p' b.log)
[[ -n $stopped ]] || fail "Ctrl-C: no 'stopped ... resume with' line:\n$(cat b.log)"
[[ ! -e B && ! -e record.json ]] || fail "a stopped run wrote its final outputs: $(ls)"
resume=$(grep -A1 "^stopped " b.log | tail -1)
eval "$resume" >resumed.log 2>&1 || fail "the printed resume command failed:\n$resume\n$(cat resumed.log)"
grep -q "^resume    ckpt/checkpoint-$(printf %06d "$stopped") (step $stopped)" resumed.log ||
  fail "the resume did not continue from step $stopped:\n$(cat resumed.log)"
cmp A/model.safetensors B/model.safetensors || fail "Ctrl-C then the printed command: the model differs"
diff <(cut -d, -f1-5 a.csv) <(cut -d, -f1-5 metrics.csv) >/dev/null ||
  fail "the metrics (step, loss, grad_norm, lr, tokens) differ from the uninterrupted run's:\n$(paste -d'|' a.csv metrics.csv)"
[[ -s record.json && -s metrics.json && -s B/config.json ]] || fail "the resumed run's outputs: $(ls)"
echo "ok: Ctrl-C after step $stopped (exit 130), then '$resume' verbatim: model.safetensors byte-identical to an" \
     "uninterrupted run's"
