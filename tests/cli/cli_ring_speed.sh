# The ring-against-all-gather speed driver (experiments/ring_speed/paired_runs.py, issue #48 item 5) runs and writes a
# well-formed results folder: one row per run with its provenance and status, the ratio per method in the summary,
# the bytes per layer each scheme hands its collectives; an existing folder is never overwritten. No time is checked.
# ctest-timeout: 120
source "$(dirname "$0")/../support/cli_common.sh"
SRC=$(cd "$(dirname "$0")/../.." && pwd)
driver=("$SRC/experiments/ring_speed/paired_runs.py" "$STREAMBP" --preset tiny --seq 64 --steps 2 --rounds 1
        --methods streambp:layer_chunk=16,head_chunk=16)
python3 "${driver[@]}" --out speed >speed.txt 2>speed.log || fail "the driver:\n$(cat speed.log speed.txt)"
[[ ! -e speed.partial ]] || fail "the partial folder is left beside the results"
python3 - speed <<'PY' || fail "the driver's files:\n$(cat speed/runs.csv speed/summary.json)"
import csv, json, sys
rows = list(csv.DictReader(open(f"{sys.argv[1]}/runs.csv")))
assert [(r["scheme"], r["status"]) for r in rows] == [("ring", "passed"), ("allgather", "passed")], rows
for r in rows:
    for k in ("commit", "date", "machine", "threads", "torch_version", "preset", "dtype", "seed", "world_size",
              "bp_seconds", "load_before", "other_cores", "command"):
        assert r[k] != "", (k, r)
    assert r["world_size"] == "2" and r["layers"] == "2", r
# tiny, T = 64 over 2 ranks: a block is K and V of 1 row x 2 KV heads x 32 positions x head_dim 16 in fp32 (8 KiB).
# The ring: 3 hops of it and 2 of its fp32 sums per layer; the all-gather: 2 gathers of it and 1 reduce-scatter of
# the 2 ranks' pieces.
block = 2 * 2 * 32 * 16 * 4
assert {r["scheme"]: int(r["bytes_per_layer"]) for r in rows} == {"ring": 5 * block, "allgather": 4 * block}, rows
s = json.load(open(f"{sys.argv[1]}/summary.json"))["methods"]["streambp:layer_chunk=16,head_chunk=16"]
assert s["ring_over_allgather"]["median"] > 0 and len(s["ring_over_allgather"]["per_round"]) == 1, s
print(f"ok: the driver wrote 2 runs, ring / all-gather {s['ring_over_allgather']['median']:.2f} (not checked)")
PY
expect_exit_2 "the driver on an existing folder" "exists; results are never overwritten" python3 "${driver[@]}" --out speed
