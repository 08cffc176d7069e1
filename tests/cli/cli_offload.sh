# `--offload` as a user runs it (issue #31):
# (a) run: every method that keeps checkpoints gives the same gradients bit for bit with and without offload (fp32 and
#     bf16, GRPO with LoRA too), the tier held exactly the model's host bytes, and the device no byte more; the
#     gradients offloaded too (standard BP's alone);
# (b) train: 3 AdamW steps end on the same weights bit for bit with and without offload: the checkpoints, the
#     optimizer's states, the gradients, the parameters, all of them; one process, 2 ranks at ZeRO-1, 2 and 3 (and
#     ZeRO-3's parameter slices); resumed from offloaded states and parameters;
# (a') --offload-host-bytes (the third tier, issue #61): the first k layers' checkpoints in host memory and the rest in
#     --offload-dir, bitwise the run without offload, the tier's peak the model's host and disk parts together;
# (c) maxlen records the tier's bytes beside every probe;
# (d) bad input exits 2 naming the flag, the method or the folder, before any work; a folder that fills up mid-run
#     (a file-size limit stands in for a full disk) stops the run with the folder named and nothing half-written.
# ctest-timeout: 300
# ctest-cost: 50
source "$(dirname "$0")/../support/cli_common.sh"

# (a) tiny with 6 layers, so that the checkpoints are a visible share of the peak.
"$STREAMBP" run --preset tiny --method standard --seq 8 --save-model tiny >/dev/null
python3 - <<'PY'
import json
c = json.load(open("tiny/config.json"))
c["num_hidden_layers"] = 6
json.dump(c, open("six.json", "w"))
PY
for dtype in fp32 bf16; do
  for method in streambp:layer_chunk=16,head_chunk=24 checkpoint mst:mini_seq=3; do
    name=${method%%:*}-$dtype
    common=(--config six.json --dtype "$dtype" --method "$method" --batch 2 --seq 61 --seed 3 --threads 1)
    "$STREAMBP" run "${common[@]}" --save-grads "$name.safetensors" --json "$name.json" >/dev/null
    "$STREAMBP" run "${common[@]}" --offload checkpoints --save-grads "$name-off.safetensors" --json "$name-off.json" \
      >"$name-off.txt" || fail "run --offload checkpoints ($name):\n$(cat "$name-off.txt")"
    "$STREAMBP" compare "$name.safetensors" "$name-off.safetensors" --rtol 0 >/dev/null ||
      fail "$name: the gradients differ with the checkpoints offloaded"
    grep -q "^offload   checkpoints in memory-mapped files in .*(exact)" "$name-off.txt" ||
      fail "$name: run does not report the tier's bytes against its model:\n$(cat "$name-off.txt")"
  done
done
python3 - *.json <<'PY'
import json, sys
runs = {f: json.load(open(f)) for f in sys.argv[1:]}
for f, r in runs.items():
    if f.endswith("-off.json"):
        plain = runs[f.replace("-off.json", ".json")]
        assert r["loss"] == plain["loss"], (f, r["loss"], plain["loss"])
        assert r["host_peak_bytes"] == r["model_host_bytes"] > 0, (f, r["host_peak_bytes"], r["model_host_bytes"])
        # Never more on the device (two checkpoints at most instead of all of them; lower where they are part of the
        # peak's moment, which at these small sizes is often layer 0's, where all the gradients exist).
        assert r["peak_bytes"] <= plain["peak_bytes"], (f, r["peak_bytes"], plain["peak_bytes"])
print("ok: losses equal, gradients bitwise equal, the tier held exactly its model's bytes, no device byte more")
PY
common=(--preset tiny --objective grpo:beta=0.04 --group 2 --lora rank=4,init=random --method streambp:layer_chunk=8,head_chunk=8
        --batch 4 --seq 40 --threads 1)
"$STREAMBP" run "${common[@]}" --save-grads g.safetensors >/dev/null
"$STREAMBP" run "${common[@]}" --offload checkpoints --save-grads g-off.safetensors >/dev/null
"$STREAMBP" compare g.safetensors g-off.safetensors --rtol 0 >/dev/null || fail "GRPO + LoRA: the gradients differ"
echo "ok: GRPO with LoRA offloaded, bitwise"
for method in standard streambp:layer_chunk=16,head_chunk=24; do
  kinds=grads
  [[ $method == standard ]] || kinds=checkpoints,grads
  common=(--config six.json --method "$method" --batch 2 --seq 61 --seed 3 --threads 1)
  "$STREAMBP" run "${common[@]}" --save-grads plain.safetensors --force >/dev/null
  "$STREAMBP" run "${common[@]}" --offload $kinds --save-grads grads-off.safetensors --json grads-off.json --force \
    >grads-off.txt || fail "run --offload $kinds ($method):\n$(cat grads-off.txt)"
  "$STREAMBP" compare plain.safetensors grads-off.safetensors --rtol 0 >/dev/null ||
    fail "$method: the gradients differ with --offload $kinds"
  grep -q "^offload   $kinds in memory-mapped files in " grads-off.txt ||
    fail "$method: run does not report the tier:\n$(cat grads-off.txt)"
  python3 - "$kinds" <<'PY' || fail "$method: the tier's bytes are not its model's:\n$(cat grads-off.json)"
import json, sys
r = json.load(open("grads-off.json"))
assert r["offload"] == sys.argv[1] and r["host_peak_bytes"] == r["model_host_bytes"] > 0, r
PY
done
echo "ok: the gradients offloaded (standard BP; StreamBP with its checkpoints), bitwise, the tier as modelled"

# (a') six layers' checkpoints of [2, 61, 64] fp32 (31232 bytes each): a budget of 2.5 of them keeps 2 on the host.
mkdir -p disk
common=(--config six.json --method streambp:layer_chunk=16,head_chunk=24 --batch 2 --seq 61 --seed 3 --threads 1)
"$STREAMBP" run "${common[@]}" --save-grads split-plain.safetensors >/dev/null
"$STREAMBP" run "${common[@]}" --offload checkpoints --offload-dir disk --offload-host-bytes 78080 \
  --save-grads split.safetensors --json split.json >split.txt || fail "run --offload-host-bytes:\n$(cat split.txt)"
"$STREAMBP" compare split-plain.safetensors split.safetensors --rtol 0 >/dev/null ||
  fail "--offload-host-bytes: the gradients differ from the run without offload"
grep -q "^offload   checkpoints in .* up to 78080 bytes, then memory-mapped files in disk.*(exact)" split.txt ||
  fail "--offload-host-bytes: the split tier is not reported against its model:\n$(cat split.txt)"
grep -q "^  host    layer checkpoints H\[0..2)" split.txt && grep -q "^  disk    layer checkpoints H\[2..L-1\]" split.txt ||
  fail "--offload-host-bytes: not 2 layers on the host and 4 on disk:\n$(cat split.txt)"
python3 - <<'PY' || fail "--offload-host-bytes: the record's tier bytes:\n$(cat split.json)"
import json
r = json.load(open("split.json"))
assert r["model_host_bytes"] == 2 * 31232 and r["model_disk_bytes"] == 4 * 31232, r
assert r["host_peak_bytes"] == r["model_host_bytes"] + r["model_disk_bytes"], r
PY
echo "ok: --offload-host-bytes keeps 2 layers' checkpoints on the host and 4 on disk, bitwise, as modelled"

# (b)
train=(train --preset tiny --method mst:mini_seq=4 --batch 4 --seq 48 --steps 3 --optimizer adamw:lr=1e-3 --threads 1)
"$STREAMBP" "${train[@]}" --save-model plain >/dev/null 2>&1
"$STREAMBP" "${train[@]}" --offload checkpoints --save-model off >train-off.txt 2>&1 ||
  fail "train --offload checkpoints:\n$(cat train-off.txt)"
cmp plain/model.safetensors off/model.safetensors || fail "train: the weights after 3 steps differ with offload"
grep -q "^offload   checkpoints in" train-off.txt || fail "train does not report the tier:\n$(cat train-off.txt)"
"$STREAMBP" "${train[@]}" --nproc 2 --zero 3 --save-model plain2 >/dev/null 2>&1
"$STREAMBP" "${train[@]}" --nproc 2 --zero 3 --offload checkpoints --save-model off2 >/dev/null 2>&1 ||
  fail "train --nproc 2 --zero 3 --offload checkpoints failed"
cmp plain2/model.safetensors off2/model.safetensors || fail "2 ranks, ZeRO-3: the weights differ with offload"
echo "ok: 3 training steps, 1 process and 2 ranks at ZeRO-3, bitwise the same with the checkpoints offloaded"
# The optimizer's states too (ZeRO-Offload): alone and with the checkpoints, on one process and on 2 ranks at ZeRO-1
# (states sharded) and ZeRO-3; and a run resumed from a checkpoint of offloaded states ends where the whole run does.
"$STREAMBP" "${train[@]}" --offload optimizer --save-model opt >opt.txt 2>&1 || fail "train --offload optimizer:\n$(cat opt.txt)"
cmp plain/model.safetensors opt/model.safetensors || fail "train: the weights differ with the optimizer's states offloaded"
grep -q "^offload   optimizer in" opt.txt || fail "train does not report the tier:\n$(cat opt.txt)"
"$STREAMBP" "${train[@]}" --offload checkpoints,optimizer --save-model both >/dev/null 2>&1
cmp plain/model.safetensors both/model.safetensors || fail "train: the weights differ with checkpoints and states offloaded"
"$STREAMBP" "${train[@]}" --offload grads --save-model grads >grads.txt 2>&1 || fail "train --offload grads:\n$(cat grads.txt)"
cmp plain/model.safetensors grads/model.safetensors || fail "train: the weights differ with the gradients offloaded"
"$STREAMBP" "${train[@]}" --offload checkpoints,grads,optimizer --grad-accum 2 --save-model all >all.txt 2>&1 ||
  fail "train --offload checkpoints,grads,optimizer --grad-accum 2:\n$(cat all.txt)"
"$STREAMBP" "${train[@]}" --grad-accum 2 --save-model accum >/dev/null 2>&1
cmp accum/model.safetensors all/model.safetensors || fail "train --grad-accum 2: the weights differ with all offloaded"
for zero in 1 2 3; do
  "$STREAMBP" "${train[@]}" --nproc 2 --zero $zero --save-model "z$zero" >/dev/null 2>&1
  "$STREAMBP" "${train[@]}" --nproc 2 --zero $zero --offload checkpoints,grads,optimizer --save-model "z$zero-off" \
    >/dev/null 2>&1 || fail "train --nproc 2 --zero $zero --offload checkpoints,grads,optimizer failed"
  cmp "z$zero/model.safetensors" "z$zero-off/model.safetensors" || fail "2 ranks, ZeRO-$zero: the weights differ with offload"
done
# The parameters too: one process (fetched per layer at its use, updated in the tier), alone and with everything else,
# resumed; on 2 ranks ZeRO-3's slices, every kind at once.
"$STREAMBP" "${train[@]}" --offload params --save-model params >params.txt 2>&1 || fail "train --offload params:\n$(cat params.txt)"
cmp plain/model.safetensors params/model.safetensors || fail "train: the weights differ with the parameters offloaded"
"$STREAMBP" "${train[@]}" --offload checkpoints,grads,optimizer,params --save-model every >every.txt 2>&1 ||
  fail "train --offload checkpoints,grads,optimizer,params:\n$(cat every.txt)"
cmp plain/model.safetensors every/model.safetensors || fail "train: the weights differ with everything offloaded"
grep -q "^offload   checkpoints,grads,optimizer,params in" every.txt || fail "train does not report the tier:\n$(cat every.txt)"
"$STREAMBP" "${train[@]}" --nproc 2 --zero 3 --offload checkpoints,grads,optimizer,params --save-model z3-all \
  >z3-all.txt 2>&1 || fail "train --nproc 2 --zero 3 --offload checkpoints,grads,optimizer,params:\n$(cat z3-all.txt)"
cmp z3/model.safetensors z3-all/model.safetensors || fail "2 ranks, ZeRO-3: the weights differ with the parameters offloaded"
# (a constant schedule: a finished 2-step run extends to 4 steps as a 4-step run, docs/training.md)
resume=(train --preset tiny --method streambp:layer_chunk=16,head_chunk=16 --batch 2 --seq 32
        --optimizer adamw:lr=1e-3 --threads 1 --offload optimizer,params)
"$STREAMBP" "${resume[@]}" --steps 4 --save-model whole >/dev/null 2>&1
"$STREAMBP" "${resume[@]}" --steps 2 --checkpoint-dir ck --save-every 2 >/dev/null 2>&1 || fail "train 2 steps"
"$STREAMBP" "${resume[@]}" --steps 4 --resume ck --save-model resumed >resumed.txt 2>&1 ||
  fail "train --resume with offloaded states:\n$(cat resumed.txt)"
cmp whole/model.safetensors resumed/model.safetensors || fail "a run resumed from offloaded states differs from the whole run"
echo "ok: the optimizer's states and gradients offloaded, alone and with the checkpoints, 1 process (with gradient accumulation), 2 ranks at ZeRO-1, 2 and 3, and resumed: bitwise"

# (c)
"$STREAMBP" maxlen --preset tiny --budget-bytes 3000000 --methods "streambp:layer_chunk=64,head_chunk=64" \
  --offload checkpoints,grads --max-seq 4096 --out maxlen >maxlen.txt 2>&1 || fail "maxlen --offload:\n$(cat maxlen.txt)"
python3 - maxlen/maxlen-*.csv <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
fit = [r for r in rows if r["role"] == "max"]
assert fit and fit[0]["offload"] == "checkpoints,grads", rows
assert fit[0]["host_peak_bytes"] == fit[0]["model_host_bytes"] != "", fit[0]
print("ok: maxlen --offload checkpoints,grads records the tier's bytes:", fit[0]["seq_len"], fit[0]["host_peak_bytes"])
PY

# `project --offload`: beside ALST, every method with and without, and what stops the goal.
"$STREAMBP" project --offload checkpoints,grads,optimizer --out proj >proj.txt 2>&1 ||
  fail "project --offload:\n$(cat proj.txt)"
[[ $(grep -c "^| llama-3.1-8b | H100-80GB |" proj.txt) == 24 ]] ||
  fail "project --offload: not 3 methods x 8 offload sets on Llama-3.1-8B:\n$(cat proj.txt)"
grep -q "^Goal (issue #31)" proj.txt || fail "project --offload does not state the goal:\n$(tail -5 proj.txt)"
ls proj/project-offload-*.csv >/dev/null || fail "project --offload wrote no CSV"
echo "ok: project --offload checkpoints,grads,optimizer beside ALST"

# (d)
base=(run --preset tiny --method streambp --seq 64)
expect_exit_2 "an unknown kind" "--offload: .*everything" "$STREAMBP" "${base[@]}" --offload everything
expect_exit_2 "parameters where no optimizer steps" "--offload params: no optimizer step here" \
  "$STREAMBP" "${base[@]}" --offload params
expect_exit_2 "parameters on ranks below ZeRO-3" "--offload params: on ranks the parameters move as ZeRO-3's slices" \
  "$STREAMBP" "${train[@]}" --nproc 2 --zero 2 --offload params
expect_exit_2 "optimizer states where no optimizer steps" "--offload optimizer: no optimizer step here" \
  "$STREAMBP" "${base[@]}" --offload optimizer
expect_exit_2 "maxlen's optimizer states without --optimizer" "--offload optimizer: no optimizer step here" \
  "$STREAMBP" maxlen --preset tiny --budget-bytes 3000000 --offload optimizer --model-only
expect_exit_2 "a method with nothing to offload" "--offload checkpoints: standard keeps no layer checkpoints" \
  "$STREAMBP" run --preset tiny --method standard --seq 64 --offload checkpoints
expect_exit_2 "a folder that does not exist" "--offload-dir.*no-such-dir" \
  "$STREAMBP" "${base[@]}" --offload checkpoints --offload-dir no-such-dir
expect_exit_2 "a folder that takes no files" "--offload-dir /proc: cannot create a file there" \
  "$STREAMBP" "${base[@]}" --offload checkpoints --offload-dir /proc
expect_exit_2 "a split without a disk folder" "--offload-host-bytes: name the disk tier's folder with --offload-dir" \
  "$STREAMBP" "${base[@]}" --offload checkpoints --offload-host-bytes 1000
expect_exit_2 "a split of other kinds" "--offload-host-bytes: splits the layer checkpoints .* --offload checkpoints,grads" \
  "$STREAMBP" "${base[@]}" --offload checkpoints,grads --offload-dir "$WORK" --offload-host-bytes 1000
status=0
(ulimit -f 8; "$STREAMBP" "${base[@]}" --seq 256 --offload checkpoints --offload-dir "$WORK" --json full.json) \
  >full.txt 2>&1 || status=$?
[[ $status -ne 0 && $status -lt 128 ]] || fail "a full offload folder: exit $status\n$(cat full.txt)"
grep -q -- "--offload-dir $WORK: cannot reserve" full.txt || fail "a full offload folder is not named:\n$(cat full.txt)"
[[ ! -e full.json ]] || fail "a run stopped by a full offload folder wrote its record"
echo "ok: a full offload folder stops the run (exit $status), naming $WORK, with nothing written"
