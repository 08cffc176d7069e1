# `streambp conform` with the shipped HF adapters (issue #21; needs the venv's python: STREAMBP_PYTHON):
# (a) HF gradient checkpointing passes the ci matrix end to end (fp64 at 1e-10 against the harness's oracle; bf16
#     within the low-precision rule with HF standard BP in the same dtype as the baseline); the adapters' every
#     objective, dtype, LoRA and head against the oracle is tests/oracle/conform_adapters.py's job;
# (b) the suite's negative control, verify/conform/wrong_per_chunk.py (per-chunk normalisation, DPO's skipped first
#     token), fails every case whose chunks hold different target counts, naming the tensor (one case per objective
#     and dtype); it passes only T = 2 (one chunk: its mean is the batch's); every failure stands at least 5x beyond
#     its bar (issue #28), so that no CPU's rounding can hide it.
# Usage: cli_conform_hf.sh BINARY PYTHON
# ctest-needs-python
# ctest-timeout: 600
source "$(dirname "$0")/../support/cli_common.sh"
PY=$2
SRC=$(cd "$(dirname "$0")/../.." && pwd)
export STREAMBP_PYTHON=$PY
warm_adapters "$PY"  # the adapters' imports once, not once per case (cli_conform_warm.sh)

"$STREAMBP" conform --impl hf-checkpointing --baseline hf --cases ci --out ok >ok.txt 2>ok.log ||
  fail "HF gradient checkpointing does not pass the ci matrix:\n$(cat ok.txt ok.log)"
grep -q "9 of 9 case(s) passed" ok.txt || fail "ci matrix:\n$(cat ok.txt)"
echo "ok: hf-checkpointing passes the ci matrix ($(grep -c ' PASS ' ok.txt) cases)"

status=0
"$STREAMBP" conform --impl "$PY $SRC/verify/conform/wrong_per_chunk.py" --baseline hf --out wrong \
  --only sft-T2,sft-gqa-qknorm-tied,grpo-beta0.04-grpo-token,dpo-3pairs-ls0.1,sft-lora,sft-fp32,sft-bf16 >wrong.txt 2>wrong.log ||
  status=$?
[[ $status -eq 1 ]] || fail "the wrong adapter: exit $status, expected 1:\n$(cat wrong.txt wrong.log)"
python3 - wrong/conform-*.csv <<'PY' || fail "the wrong adapter's verdicts:\n$(cat wrong.txt)"
import csv, sys
# the micro-batch cases are N/A: it does not accumulate (cli_conform_paths.sh has the micro-batch controls)
rows = {r["case"]: r for r in csv.DictReader(open(sys.argv[1])) if r["status"] != "not expressible"}
passed = sorted(c for c, r in rows.items() if r["status"] == "passed")
assert passed == ["sft-T2"], passed
for case, r in rows.items():
    if case != "sft-T2" and r["status"] != "not expressible":  # the sequence-parallel cases: one process
        # judged on its gradients (not a crash): the worst tensor is named and at least 5x beyond the bar (fp64: the
        # normwise 1e-10; fp32/bf16: the low-precision rule's statistic, 1 at the allowance)
        bar = 1e-10 if r["dtype"] == "fp64" else 1.0
        assert r["worst_tensor"] and float(r["worst"]) >= 5 * bar, r
print("ok: the wrong adapter fails", sum(r["status"] == "failed" for r in rows.values()), "cases, each with its worst tensor")
PY
