# The binary must start on a machine without a GPU driver: libcuda.so.1 is never a direct dependency (ARCHITECTURE.md §10),
# and it does start here (these machines have no driver).
source "$(dirname "$0")/../support/cli_common.sh"
needed=$(readelf -d "$STREAMBP" | grep NEEDED)
echo "$needed"
if grep -q 'libcuda\.so' <<<"$needed"; then fail "libcuda is NEEDED by $STREAMBP"; fi
"$STREAMBP" --help >/dev/null
echo "ok: no libcuda NEEDED, and the binary starts"

# Without a GPU, --device cuda is a usage error (exit 2) that says why, in every command that takes it; never a
# silent CPU run. (On a GPU machine tests/gpu/run.sh covers the device instead.)
if ! nvidia-smi -L >/dev/null 2>&1; then
  for cmd in "run --preset tiny --method streambp --seq 8" "verify --seq 8" "demo --seq 64" \
             "sweep seq --preset tiny --seq 64" "maxlen --preset tiny --budget-bytes 1000000"; do
    # shellcheck disable=SC2086
    expect_exit_2 "$cmd --device cuda" "--device cuda: (no CUDA device|built without CUDA)" "$STREAMBP" $cmd --device cuda
  done
  expect_exit_2 "--device cuda:1" "--device cuda:1: " "$STREAMBP" run --preset tiny --method standard --seq 8 --device cuda:1
fi
expect_exit_2 "--device tpu" "expected cpu, cuda or cuda:N" "$STREAMBP" run --preset tiny --method standard --seq 8 --device tpu
expect_exit_2 "--device cuda:x" "expected cpu, cuda or cuda:N" "$STREAMBP" run --preset tiny --method standard --seq 8 --device cuda:x
expect_exit_2 "--profile cupti on the CPU" "--profile cupti needs --device cuda" \
  "$STREAMBP" run --preset tiny --method standard --seq 8 --profile cupti --timeline "$WORK/t"
