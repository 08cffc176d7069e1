# The harness's floating-point verdicts as a user meets them, run by CTest once per CPU configuration (issue #28: a
# verdict that changes with ATEN_CPU_CAPABILITY or ONEDNN_MAX_CPU_ISA is a bug in the verdict):
# (a) `verify --gate` passes StreamBP at 1 to 96 layer chunks, checkpointing and MsT in fp32, bf16 and bf16-mixed;
# (b) `conform` passes the harness's own StreamBP (verify/conform/streambp_adapter.py) on every fp32 and bf16 case of
#     the full matrix (SFT, GRPO, DPO, LoRA) against its own standard BP as the baseline: the command that failed
#     sft-bf16 at 1.03x the former fixed 1.5x allowance on an AVX2-only CPU.
# The configuration this run sees is printed first. Usage: cli_verdicts.sh BINARY
# ctest-every-cpu-configuration
# ctest-timeout: 600
# ctest-cost: 25
source "$(dirname "$0")/../support/cli_common.sh"
HERE=$(cd "$(dirname "$0")" && pwd)
echo "configuration: ATEN_CPU_CAPABILITY=${ATEN_CPU_CAPABILITY:-native} ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-native}"

# (a)
"$STREAMBP" verify --seq 96 --mixed --gate --out verify --threads 1 \
  --methods "streambp:layer_chunk=96,head_chunk=96;streambp:layer_chunk=8,head_chunk=16;streambp:layer_chunk=1,head_chunk=5;checkpoint;mst:mini_seq=8" \
  >verify.txt 2>verify.log || fail "verify --gate failed:\n$(cat verify.log | grep gate)\n$(cat verify.txt)"
worst=$(python3 -c "
import csv, glob
rows = [r for r in csv.DictReader(open(glob.glob('verify/verify-*.csv')[0])) if r['gate_ratio']]
w = max(rows, key=lambda r: float(r['gate_ratio']))
print(w['gate_ratio'], w['run'], w['worst_tensor'])")
echo "ok: verify --gate, worst $worst of the allowance"
# The console's last line is the verdict (what a reader of a CI log looks for).
grep -qE "^gate: PASS: 15 runs against standard BP in the same dtype; worst 0\.[0-9]+ of the allowance" verify.txt ||
  fail "verify --gate printed no PASS verdict line:\n$(tail -3 verify.txt)"

# (b)
ours=(python3 "$HERE/../../verify/conform/streambp_adapter.py" --streambp "$STREAMBP")
"$STREAMBP" conform --impl "${ours[*]}" --baseline "${ours[*]} --method standard" --cases full --dtypes bf16,fp32 \
  --out conform >conform.txt 2>conform.log || fail "the harness's own StreamBP does not conform:\n$(cat conform.txt conform.log)"
grep -qE "([0-9]+) of \1 case\(s\) passed" conform.txt || fail "not every case passed:\n$(cat conform.txt)"
echo "ok: conform, $(grep -oE '[0-9]+ of [0-9]+ case\(s\) passed' conform.txt); worst: $(sort -k4 -g conform.txt | grep PASS | tail -1)"
