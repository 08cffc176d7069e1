# The micro-benchmarks in CI mode (--short): every family runs (the file tier's copies too), the JSON Google Benchmark
# writes parses and carries each family and its provenance, no row is an error; a device that is not there is a usage
# error (exit 2).
# ctest-binary: streambp_bench
# ctest-timeout: 60
source "$(dirname "$0")/../support/cli_common.sh"

"$STREAMBP" --short --benchmark_out=b.json --benchmark_out_format=json >bench.txt 2>&1 ||
  fail "streambp_bench --short exited $?:\n$(cat bench.txt)"
python3 - <<'PY' || fail "b.json:\n$(cat b.json)"
import json
r = json.load(open("b.json"))
context = r["context"]
for key in ["device", "preset", "dtype", "torch_version", "commit", "threads"]:
    assert context.get(key) not in ("", None), (key, context.get(key))
assert (context["device"], context["preset"], context["dtype"]) == ("cpu", "tiny", "fp32"), context
rows = r["benchmarks"]
for row in rows:
    assert not row.get("error_occurred"), row
    if row["name"].startswith("file_tier/"):  # the offload tier's copies: bytes, not tokens or FLOPs
        assert row["real_time"] > 0 and row["bytes_per_second"] > 0 and row["tensor_bytes"] == 2**20, row
        continue
    assert row["real_time"] > 0 and row["tokens_per_second"] > 0 and row["flop_per_second"] > 0, row
names = [row["name"] for row in rows]
assert {n.split("/")[1] for n in names if n.startswith("file_tier/")} == {"store", "fetch", "store_synced",
                                                                          "fetch_cold"}, names
for key in ["machine", "date_utc", "offload_dir"]:
    assert context.get(key) not in ("", None), (key, context.get(key))
for family in ["head_chunk", "layer_chunk", "attention_chunk", "kv_chunk"]:
    assert any(n.split("/")[0] == family for n in names), (family, names)
# Every method of the catalogue, one whole step each (step/<method>/T:64 in --short mode).
assert len({n.split("/")[1] for n in names if n.startswith("step/")}) >= 4, names
print("ok: families and context in the JSON:", ", ".join(names))
PY

# No GPU here: --device cuda is refused before any benchmark runs, with the CUDA runtime's reason.
if ! nvidia-smi -L >/dev/null 2>&1; then
  expect_exit_2 "--device cuda" "--device cuda: " "$STREAMBP" --short --device cuda
fi
expect_failure "unknown device" "expected cpu, cuda or cuda:N" "$STREAMBP" --short --device tpu
expect_failure "unknown preset" "unknown preset 'nosuch'" "$STREAMBP" --short --preset nosuch
