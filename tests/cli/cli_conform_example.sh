# The adapter the README offers to copy, verify/conform/example_adapter.py (issue #44), on the quick matrix: every SFT
# case passes but the micro-batch step, which it declines (fp64 at 1e-10 on each model family the matrix writes:
# Qwen3 and the Qwen2-shaped MHA/bias case; LoRA
# under PEFT's saved names), every other case is N/A (exit status 3, the reason named), none fails; nothing stays in
# $TMPDIR. The baseline of its fp32/bf16 cases is the harness's own standard BP (no second torch start per case).
# Usage: cli_conform_example.sh BINARY PYTHON
# ctest-needs-python
# ctest-timeout: 600
source "$(dirname "$0")/../support/cli_common.sh"
PY=$2
SRC=$(cd "$(dirname "$0")/../.." && pwd)
warm_adapters "$PY"  # the adapters' imports once, not once per case (cli_conform_warm.sh)

"$STREAMBP" conform --impl "$PY $SRC/verify/conform/example_adapter.py" --cases quick \
  --baseline "python3 $SRC/verify/conform/streambp_adapter.py --streambp $STREAMBP --method standard" \
  --out ok >ok.txt 2>ok.log || fail "the example adapter does not pass the quick matrix:\n$(cat ok.txt ok.log)"
grep -q "7 of 7 case(s) passed (11 more not expressible by the implementation)" ok.txt ||
  fail "quick matrix:\n$(cat ok.txt)"
[[ $(grep -cE "^(grpo|dpo)-.* N/A .*objective (grpo|dpo): this adapter implements SFT only" ok.txt) -eq 7 ]] ||
  fail "the GRPO and DPO cases are not N/A with their reason:\n$(cat ok.txt)"
[[ $(grep -cE "^sft-sp[0-9]-.* N/A .*ranks: this adapter runs one process" ok.txt) -eq 2 ]] ||
  fail "the sequence-parallel cases are not N/A with their reason:\n$(cat ok.txt)"
grep -qE "^sft-micro3 .* N/A .*3 micro-batches: this adapter runs one batch per optimizer step" ok.txt ||
  fail "the micro-batch case is not N/A with its reason:\n$(cat ok.txt)"
grep -qE "^sft-mha-bias-untied .* PASS" ok.txt && grep -qE "^sft-lora .* PASS" ok.txt ||
  fail "the Qwen2-shaped or the LoRA case:\n$(cat ok.txt)"
# packed rows: model_inputs hands HF position_ids and no mask (HF's own packed path), declared by run(packs=True)
grep -qE "^sft-packed .* PASS" ok.txt || fail "the packed case:\n$(cat ok.txt)"
echo "ok: the example adapter passes $(grep -c ' PASS ' ok.txt) SFT cases, $(grep -c ' N/A ' ok.txt) N/A"
find "$TMPDIR" -maxdepth 1 -name 'streambp-conform-*' | grep -q . && fail "left in \$TMPDIR: $(ls -A "$TMPDIR")"
echo "ok: no case directory left in \$TMPDIR"
