# `streambp project --sp N --disk-bytes-per-node B --disk-read-bandwidth R` (issue #61): a third tier for the
# offloaded checkpoints the host cannot hold, node-local disk, whole layers.
# (a) bad input exits 2 naming the flag: a disk without --sp or without checkpoints offloaded, without a read rate, a
#     rate without a disk, NaN (a host of NaN bytes too: it ended in an internal error), negative values, a device
#     rate of 0;
# (b) without the disk tier nothing changes: the same rows and no disk columns;
# (c) a host of 0.5 TB per node: the host-bound rows (checkpoints in the tier) are lifted by the disk, every placement
#     within both budgets, the stall factor the read time over the compute time, a layer's read the disk's bytes over
#     the disk-held layers at the node's rate;
# (d) a disk too small: the disk binds, and says so.
# ctest-cost: 4
source "$(dirname "$0")/../support/cli_common.sh"

p=(project --sp 8 --sp-scheme ring)
expect_exit_2 "a disk without --sp" "--disk-bytes-per-node needs --sp N" "$STREAMBP" project --disk-bytes-per-node 1e12
expect_exit_2 "a disk without checkpoints offloaded" "--disk-bytes-per-node needs --sp N and --offload with checkpoints" \
  "$STREAMBP" "${p[@]}" --offload grads --disk-bytes-per-node 1e12 --disk-read-bandwidth 1e9
expect_exit_2 "a disk without a read rate" "--disk-read-bandwidth: a disk tier" \
  "$STREAMBP" "${p[@]}" --offload checkpoints --disk-bytes-per-node 1e12
expect_exit_2 "a read rate without a disk" "--disk-read-bandwidth needs --disk-bytes-per-node" \
  "$STREAMBP" "${p[@]}" --offload checkpoints --disk-read-bandwidth 1e9
expect_exit_2 "a disk of NaN bytes" "--disk-bytes-per-node nan: not a finite non-negative number" \
  "$STREAMBP" "${p[@]}" --offload checkpoints --disk-bytes-per-node nan --disk-read-bandwidth 1e9
expect_exit_2 "a negative read rate" "--disk-read-bandwidth -1: not a finite non-negative number" \
  "$STREAMBP" "${p[@]}" --offload checkpoints --disk-bytes-per-node 1e12 --disk-read-bandwidth -1
expect_exit_2 "a host of NaN bytes" "--host-bytes-per-node nan: not a finite positive number" \
  "$STREAMBP" "${p[@]}" --offload checkpoints --host-bytes-per-node nan
expect_exit_2 "a device of 0 FLOP/s" "--device-flops 0: not a finite positive number" \
  "$STREAMBP" "${p[@]}" --offload checkpoints --disk-bytes-per-node 1e12 --disk-read-bandwidth 1e9 --device-flops 0

run() {
  local name=$1
  shift
  "$STREAMBP" "${p[@]}" --offload checkpoints,optimizer --out "$name" "$@" >"$name.txt" 2>&1 ||
    fail "project $*:\n$(cat "$name.txt")"
}
run host --host-bytes-per-node 5e11
run host-disk --host-bytes-per-node 5e11 --disk-bytes-per-node 3e13 --disk-read-bandwidth 2.5e10
run small-disk --host-bytes-per-node 5e11 --disk-bytes-per-node 2e11 --disk-read-bandwidth 2.5e10
grep -q "^What stops a longer T: the host" host.txt || fail "not host-bound without the disk:\n$(cat host.txt)"
grep -q "^What stops a longer T: the disk" small-disk.txt || fail "not disk-bound:\n$(cat small-disk.txt)"
grep -qE "^The disk tier at T\*: H\[[0-9]+\.\.31\] on disk, .* stall factor " host-disk.txt ||
  fail "no stall factor:\n$(cat host-disk.txt)"
python3 - host/*.csv host-disk/*.csv small-disk/*.csv <<'PY' || fail "project CSVs with a disk tier"
import csv, sys
host, disk, small = (list(csv.DictReader(open(p))) for p in sys.argv[1:4])
assert "stall_factor" not in host[0] and "stall_factor" in disk[0], (host[0].keys(), disk[0].keys())
for rows, budget in ((disk, 3e13), (small, 2e11)):
    for r in rows:
        assert int(r["host_bytes_per_node"]) <= 5e11 and float(r["disk_bytes_per_node"]) <= budget, r
        held = int(r["host_layers"]) < 32 if r["preset"] == "llama-3.1-8b" else int(r["host_layers"]) < 36
        assert held == (float(r["disk_bytes_per_node"]) > 0), r
        if held:
            layers_on_disk = (32 if r["preset"] == "llama-3.1-8b" else 36) - int(r["host_layers"])
            read = float(r["disk_bytes_per_node"]) / layers_on_disk / float(r["disk_read_bandwidth"])
            assert abs(float(r["layer_read_seconds"]) / read - 1) < 1e-5, r
            assert abs(float(r["stall_factor"]) / (float(r["layer_read_seconds"]) / float(r["layer_backward_seconds"])) - 1) < 1e-4, r
by = lambda rows: {(r["preset"], r["offload"]): int(r["model_max_seq"]) for r in rows}
h, d = by(host), by(disk)
lifted = [k for k, T in h.items() if T < d[k]]
assert lifted and all("checkpoints" in k[1] for k in lifted), (h, d)
assert all(d[k] >= T for k, T in h.items()), (h, d)
print("ok: the disk lifts", len(lifted), "host-bound rows, e.g.", lifted[0], h[lifted[0]], "->", d[lifted[0]])
PY
echo "ok: project's disk tier"
