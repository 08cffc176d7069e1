#!/usr/bin/env bash
# The bf16 GEMM paths' choice from the command line (core/model/gemm_store.h, issue #49), timing nothing: under
# STREAMBP_GEMM_PROBE=off (the tests' setting) a process with an empty cache folder takes the flag rule and
# writes nothing there, `gemm-path` shows that choice without measuring, `run` prints the choice and where it came
# from, STREAMBP_NARROW_GEMM=native|widened pins it, and a bad value is a usage error naming the variable. A training
# run resumed by a process whose own choice differs from the checkpoint's keeps the checkpoint's paths and ends
# bitwise equal to an uninterrupted run on them.
source "$(dirname "$0")/../support/cli_common.sh"

mkdir cache
export STREAMBP_CACHE=$WORK/cache STREAMBP_GEMM_PROBE=off
unset STREAMBP_NARROW_GEMM  # the suite may run pinned: this script sets it where it means to
tiny=(run --preset tiny --method streambp --seq 16 --dtype bf16 --threads 1)

"$STREAMBP" gemm-path >show.log 2>&1 || fail "gemm-path:\n$(cat show.log)"
grep -q "^machine   .*, bf16, " show.log || fail "gemm-path names no key:\n$(cat show.log)"
grep -qE "^bf16      nt=(native|widened),nn=(native|widened),tn=(native|widened) \(.*(none stored in $WORK/cache|nothing to measure)" show.log ||
  fail "gemm-path on an empty cache:\n$(cat show.log)"
echo "ok: $(grep '^bf16 ' show.log)"

"$STREAMBP" "${tiny[@]}" >stored.log 2>&1 || fail "run:\n$(cat stored.log)"
grep -qE "^kernels   bf16 GEMMs nt=[a-z]+,nn=[a-z]+,tn=[a-z]+ \(.+\)" stored.log ||
  fail "run prints no choice:\n$(cat stored.log)"
[[ -z $(ls cache) ]] || fail "a process under STREAMBP_GEMM_PROBE=off wrote to the cache: $(ls cache)"
echo "ok: $(grep '^kernels   bf16' stored.log)"

for path in native widened; do
  STREAMBP_NARROW_GEMM=$path "$STREAMBP" "${tiny[@]}" >$path.log 2>&1 || fail "run pinned $path:\n$(cat $path.log)"
  grep -q "^kernels   bf16 GEMMs nt=$path,nn=$path,tn=$path (pinned by STREAMBP_NARROW_GEMM=$path)" $path.log ||
    fail "STREAMBP_NARROW_GEMM=$path:\n$(cat $path.log)"
done
echo "ok: pinned native and widened"
STREAMBP_NARROW_GEMM=fast expect_exit_2 "STREAMBP_NARROW_GEMM=fast" \
  "STREAMBP_NARROW_GEMM: GEMM path 'fast' \\(expected native or widened\\)" "$STREAMBP" "${tiny[@]}"

# The resume: checkpoints written on the path this process would not take, resumed under its own choice.
own=$(sed -n 's/^bf16      nt=\([a-z]*\),.*/\1/p' show.log)
other=$([[ $own == native ]] && echo widened || echo native)
# d = 256: products long enough that the two paths' bits differ (on tiny's d = 64 they are equal here).
cat >mid.json <<'JSON'
{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512, "hidden_size": 256,
 "intermediate_size": 768, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
 "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
 "rope_scaling": null, "tie_word_embeddings": true, "attention_bias": false, "torch_dtype": "bfloat16"}
JSON
train=(train --config mid.json --method streambp --dtype bf16 --seq 64 --batch 1 --seed 3 --threads 1 --save-every 1)
STREAMBP_NARROW_GEMM=$other "$STREAMBP" "${train[@]}" --steps 2 --checkpoint-dir A --save-model AM >a.log 2>&1 ||
  fail "uninterrupted run on $other:\n$(cat a.log)"
STREAMBP_NARROW_GEMM=$own "$STREAMBP" "${train[@]}" --steps 2 --checkpoint-dir O --save-model OM >o.log 2>&1 ||
  fail "uninterrupted run on $own:\n$(cat o.log)"
! cmp -s AM/model.safetensors OM/model.safetensors ||
  fail "the two GEMM paths gave the same bits: the resume below could not tell them apart"
STREAMBP_NARROW_GEMM=$other "$STREAMBP" "${train[@]}" --steps 1 --checkpoint-dir B >b.log 2>&1 || fail "step 1:\n$(cat b.log)"
"$STREAMBP" "${train[@]}" --steps 2 --checkpoint-dir B --resume B --save-model BM >b2.log 2>&1 ||
  fail "resume:\n$(cat b2.log)"
grep -q "^note      the checkpoint's bf16 GEMM paths (nt=$other,nn=$other,tn=$other) are kept" b2.log ||
  fail "no note on the kept paths:\n$(cat b2.log)"
cmp AM/model.safetensors BM/model.safetensors || fail "the resumed run is not bitwise the uninterrupted one on $other"
echo "ok: resumed on the checkpoint's $other path, bitwise (this process's own: $own)"

# A training run says and records the paths it took: its console, its record and its metrics' sidecar.
STREAMBP_NARROW_GEMM=$other "$STREAMBP" "${train[@]}" --steps 1 --checkpoint-dir C --json rec.json --metrics m.csv \
  >b3.log 2>&1 || fail "train with --json and --metrics:\n$(cat b3.log)"
grep -q "^kernels   bf16 GEMMs nt=$other,nn=$other,tn=$other (" b3.log || fail "train does not print its paths:\n$(cat b3.log)"
for f in rec.json m.json; do
  grep -q "\"paths\": \"nt=$other,nn=$other,tn=$other\"" $f || fail "$f does not record the paths:\n$(cat $f)"
done
echo "ok: train prints and records the paths it took"
