# The run record (--json) carries the numbers and where they came from (ARCHITECTURE.md §9); its status claims only what ran
# (`unchecked`: a run compares no gradient; `oom`: no time or peak).
source "$(dirname "$0")/../support/cli_common.sh"
"$STREAMBP" run --preset tiny --method streambp:layer_chunk=8,head_chunk=8 --dtype fp32 --batch 2 --seq 33 \
  --pad-fraction 0.2 --seed 3 --json run.json
python3 - <<'PY'
import json, math
r = json.load(open("run.json"))
def number(key):
    value = r[key]
    assert isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), (key, value)
    return value
assert r["status"] == "unchecked", r["status"]  # a run checks no gradient
assert number("loss") > 0
assert isinstance(r["peak_bytes"], int) and r["peak_bytes"] > 0, r["peak_bytes"]
assert isinstance(r["model_peak_bytes"], int) and r["model_peak_bytes"] > 0, r["model_peak_bytes"]
assert number("bp_seconds") > 0
for key, value in [("method", "streambp:layer_chunk=8,head_chunk=8"), ("dtype", "fp32"), ("preset", "tiny"),
                   ("seed", 3), ("batch_size", 2), ("seq_len", 33), ("chunk_attention", "cpu flash")]:
    assert r[key] == value, (key, r[key])
p = r["provenance"]
for key in ["commit", "date", "machine", "threads", "torch_version", "command"]:
    assert key in p and p[key] not in ("", None), (key, p.get(key))
assert "--json run.json" in p["command"], p["command"]
print("ok: run record", {k: r[k] for k in ["status", "loss", "peak_bytes", "model_peak_bytes", "bp_seconds"]})
PY

# The console says what the record says: a run checks no gradient. The chunk-attention line is StreamBP's only.
"$STREAMBP" run --preset tiny --method standard --seq 16 >console.txt
grep -q "^status    unchecked  (the step ran; run checks no gradient" console.txt ||
  fail "the console's status is not the record's:\n$(cat console.txt)"
! grep -q "^attention" console.txt || fail "standard BP printed StreamBP's attention kernel:\n$(cat console.txt)"
"$STREAMBP" run --preset tiny --method streambp:layer_chunk=8,head_chunk=8 --seq 16 | grep -q "^attention " ||
  fail "StreamBP's run does not name its chunk attention"
echo "ok: the console says unchecked"

# --model-only: the same workload's analytic model, no step run, the same number as the measured record's model.
"$STREAMBP" run --preset tiny --method streambp:layer_chunk=8,head_chunk=8 --dtype fp32 --batch 2 --seq 33 \
  --pad-fraction 0.2 --seed 3 --model-only --json model.json
expect_exit_2 "--model-only with --timeline" "needs a step" "$STREAMBP" run --preset tiny --method streambp --seq 33 --model-only --timeline never
# ...but the step's inputs need none: --model-only writes the model and batch a later step (or another library) takes.
"$STREAMBP" run --preset tiny --method standard --seq 33 --model-only --save-model inputs-model \
  --save-batch inputs.safetensors >inputs.txt 2>&1 || fail "--model-only with --save-model, --save-batch:\n$(cat inputs.txt)"
[[ -s inputs-model/config.json && -s inputs-model/model.safetensors && -s inputs.safetensors ]] ||
  fail "--model-only did not write the model and batch: $(ls)"
echo "ok: --model-only writes --save-model and --save-batch"
python3 - <<'PY'
import json
r, m = json.load(open("run.json")), json.load(open("model.json"))
assert m["status"] == "model-only", m["status"]
assert "peak_bytes" not in m and "bp_seconds" not in m, sorted(m)
assert m["model_peak_bytes"] == r["model_peak_bytes"], (m["model_peak_bytes"], r["model_peak_bytes"])
assert m["model_terms"] == r["model_terms"] and m["model_peak_moment"] == r["model_peak_moment"]
print("ok: --model-only gives the run's model", m["model_peak_bytes"])
PY

# An over-budget step (run past the memory check, so that the meter stops it): status oom, exit 3, and no time or
# peak (the step did not finish: its numbers are partial).
status=0
"$STREAMBP" run --preset tiny --method standard --dtype fp32 --batch 2 --seq 33 --budget-bytes 100000 --no-memory-check --json oom.json \
  >oom.txt 2>&1 || status=$?
[[ $status -eq 3 ]] || fail "an oom run exited $status, expected 3:\n$(cat oom.txt)"
python3 - <<'PY'
import json
r = json.load(open("oom.json"))
assert r["status"] == "oom", r["status"]
for key in ["loss", "peak_bytes", "bp_seconds", "bp_seconds_all", "largest_allocation_bytes"]:
    assert r[key] is None, (key, r[key])
assert r["model_peak_bytes"] > 100000, r["model_peak_bytes"]
print("ok: an oom record leaves loss, time and peak empty")
PY
# ... and writes no file that looks like a result: not the gradients, nor the model and the batch (issue #44).
status=0
"$STREAMBP" run --preset tiny --method standard --dtype fp32 --batch 2 --seq 33 --budget-bytes 100000 --json oom2.json \
  --save-grads g.safetensors --save-model M --save-batch b.safetensors >oom2.txt 2>&1 || status=$?
[[ $status -eq 3 ]] || fail "an oom run exited $status, expected 3:\n$(cat oom2.txt)"
[[ -s oom2.json && ! -e g.safetensors && ! -e M && ! -e b.safetensors ]] || fail "an oom run wrote: $(ls)"
grep -q "^outputs   not written: --save-grads g.safetensors, --save-model M, --save-batch b.safetensors (the step did not finish: oom)" \
  oom2.txt || fail "an oom run does not say what it did not write:\n$(cat oom2.txt)"
echo "ok: an oom run writes its record and no --save-grads, --save-model or --save-batch"
