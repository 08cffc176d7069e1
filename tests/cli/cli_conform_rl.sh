# `streambp conform --cases rl` (issue #60, docs/rl-steps.md): whole GRPO trainer steps judged at every optimizer step.
# (a) TRL 1.16.0's GRPOTrainer through its own train() (verify/conform/survey/trl_grpo.py) passes the 9 cases, its
#     advantages, completion mask and generation-time log-probs judged beside the gradients; CSV and JUnit rows;
# (b) the negative controls (tests/support/conform_rl_faults.py: one known trainer bug planted in TRL each): pads
#     attended, the EOS mask off by one, advantages over the batch instead of the group, dapo's normaliser per
#     micro-batch, old_logps from the current pass; each fails its case naming the tensor where it shows first (the
#     last only at the second optimizer step);
# (c) an adapter that does not declare RL steps (hf) reports them N/A, and the TRL adapter a batch case.
# Usage: cli_conform_rl.sh BINARY PYTHON
# ctest-needs-python
# ctest-timeout: 900
# ctest-cost: 40
source "$(dirname "$0")/../support/cli_common.sh"
PY=$2
SRC=$(cd "$(dirname "$0")/../.." && pwd)
export STREAMBP_PYTHON=$PY
warm_adapters "$PY" torch safetensors.torch transformers transformers.models.qwen3.modeling_qwen3 datasets trl \
  trl.trainer.grpo_trainer
trl_grpo="$PY $SRC/verify/conform/survey/trl_grpo.py"
faults="$PY $SRC/tests/support/conform_rl_faults.py"

# check RUN CASE STATUS TENSOR_REGEX [PROBLEM_REGEX]: run RUN's CSV row of CASE has STATUS and a worst tensor matching
# TENSOR_REGEX (and a problem or hint matching PROBLEM_REGEX in its output line)
check() {
  python3 - "$1"/conform-*.csv "$2" "$3" "$4" <<'PY' || fail "$1's verdicts:\n$(cat "$1.txt")"
import csv, re, sys
rows = {r["case"]: r for r in csv.DictReader(open(sys.argv[1]))}
r = rows[sys.argv[2]]
assert r["status"] == sys.argv[3], (r["status"], r["problem"])
assert re.fullmatch(sys.argv[4], r["worst_tensor"]), r["worst_tensor"]
PY
  [[ -z ${5:-} ]] || grep -Eq "$5" "$1.txt" || fail "$1: no '$5' in\n$(cat "$1.txt")"
}

# (a)
"$STREAMBP" conform --impl "$trl_grpo" --cases rl --junit rl.xml --out pass >pass.txt 2>&1 || fail "TRL:\n$(cat pass.txt)"
grep -q "9 of 9 case(s) passed" pass.txt || fail "$(cat pass.txt)"
for c in rl-dapo-group-ga2 rl-grpo-batch-spg2 rl-bnpo-none-iter2-sequence rl-dr_grpo-masktrunc-ga2 rl-dapo-kl-spg2 \
    rl-dapo-masktrunc-ga2 rl-grpo-one-t09 rl-bnpo-one-t09 rl-grpo-one-t1; do
  check pass "$c" passed 'step[12]/model\..*'
done
python3 - rl.xml <<'PY' || fail "JUnit:\n$(cat rl.xml)"
import sys, xml.etree.ElementTree as ET
cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
names = sorted((c.get("classname"), c.get("name")) for c in cases)
assert len(names) == 9 and all(k == "streambp.conform.grpo" and n.startswith("rl-") and n.endswith("-fp64")
                               for k, n in names), names
PY

# (b)
run_fault() {  # BUG CASE: the fault's run must fail (exit 1)
  if "$STREAMBP" conform --impl "$faults $1" --cases rl --only "$2" --out "$1" >"$1.txt" 2>&1; then
    fail "the $1 bug passed:\n$(cat "$1.txt")"
  fi
}
run_fault pads rl-dr_grpo-masktrunc-ga2
check pads rl-dr_grpo-masktrunc-ga2 failed token_logps "departs first at token_logps .* pads attended"
run_fault eos rl-dapo-group-ga2
check eos rl-dapo-group-ga2 failed completion_mask "departs first at completion_mask differs at .* the EOS mask"
run_fault advantages rl-dapo-group-ga2
check advantages rl-dapo-group-ga2 failed advantages "departs first at advantages .* scale_rewards"
run_fault normaliser rl-dapo-group-ga2
check normaliser rl-dapo-group-ga2 failed 'step1/model\..*' "the first optimizer step departs .* normaliser"
run_fault old_logps rl-grpo-batch-spg2
check old_logps rl-grpo-batch-spg2 failed 'step2/model\..*' "step 1 agrees, step 2 departs: .*old_logps"

# (c)
if "$STREAMBP" conform --impl hf --cases rl --only rl-dapo-group-ga2 --out hf >hf.txt 2>&1; then
  fail "hf judged an RL step:\n$(cat hf.txt)"
fi
grep -q "not expressible: .*does not declare RL steps" hf.txt || fail "$(cat hf.txt)"
if "$STREAMBP" conform --impl "$trl_grpo" --cases ci --only sft-gqa-qknorm-tied --out batch >batch.txt 2>&1; then
  fail "the TRL adapter judged a batch case:\n$(cat batch.txt)"
fi
grep -q "not expressible: .*runs whole RL steps (kind rl_step) only" batch.txt || fail "$(cat batch.txt)"
echo "PASS cli_conform_rl"
