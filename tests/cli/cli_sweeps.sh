# The reproduction drivers as a user runs them (issue #9): a sequence sweep that records an over-budget run as an
# `oom` row with empty cells, resumes after an interruption without re-measuring what it has, and the linear toy.
# ctest-cost: 45
source "$(dirname "$0")/../support/cli_common.sh"

col() {  # col FILE METHOD SEQ COLUMN: one cell of the sweep CSV
  python3 - "$@" <<'PY'
import csv, sys
f, method, seq, column = sys.argv[1:]
rows = [r for r in csv.DictReader(open(f)) if r["method"] == method and r["seq_len"] == seq]
assert len(rows) == 1, f"{len(rows)} rows for {method} T={seq} in {f}"
print(rows[0][column])
PY
}

# A budget between checkpointing's and standard BP's peak at T = 128 on tiny: standard is oom there.
"$STREAMBP" sweep seq --preset tiny --seq 64 --methods "standard;checkpoint;streambp:layer_chunk=16,head_chunk=16" \
  --repeats 1 --check-seq 37 --budget-bytes 2500000 --out out >log.txt 2>&1 || fail "sweep exited non-zero:\n$(cat log.txt)"
csv=$(ls out/seq-*.csv)
[[ $(col "$csv" standard 64 status) == reference ]] || fail "standard rows are the reference"
[[ $(col "$csv" checkpoint 64 status) == passed ]] || fail "checkpoint was checked"
[[ $(col "$csv" checkpoint 64 check_seq) == 37 ]] || fail "the check's own length is recorded"
python3 -c "import sys; assert float(sys.argv[1]) > 0 and float(sys.argv[2]) > 0 and 0 < float(sys.argv[3])" \
  "$(col "$csv" checkpoint 64 flops)" "$(col "$csv" checkpoint 64 gemm_flops_per_second)" \
  "$(col "$csv" checkpoint 64 gemm_efficiency)" || fail "FLOP columns"
# The peak counts the weights (issue #44: the legend said "above the model and batch").
grep -q "peak: the step's measured peak, the model's weights included" log.txt || fail "the legend of peak:\n$(cat log.txt)"
first_date=$(col "$csv" checkpoint 64 date)
sleep 1
# Resume with one more length: T = 64 is not measured again, T = 128 is added.
"$STREAMBP" sweep seq --preset tiny --seq 64,128 --methods "standard;checkpoint;streambp:layer_chunk=16,head_chunk=16" \
  --repeats 1 --check-seq 0 --budget-bytes 2500000 --resume "$csv" >log2.txt 2>&1 || fail "resume exited non-zero:\n$(cat log2.txt)"
grep -q "2 rows\|3 rows" log2.txt || fail "resume did not report the rows it kept:\n$(cat log2.txt)"
[[ $(col "$csv" checkpoint 64 date) == "$first_date" ]] || fail "resume re-measured a finished row"
[[ $(col "$csv" standard 128 status) == oom ]] || fail "standard at T=128 should be over the 2.5 MB budget"
[[ -z $(col "$csv" standard 128 peak_bytes) && -z $(col "$csv" standard 128 bp_seconds) ]] || fail "oom rows have empty cells"
[[ -n $(col "$csv" standard 128 model_peak_bytes) ]] || fail "oom rows keep the analytic model"
[[ -z $(col "$csv" standard 128 gemm_efficiency) ]] || fail "oom rows have no achieved FLOP/s"
[[ $(col "$csv" checkpoint 128 status) == unchecked ]] || fail "no check ran in the resumed part"
python3 -c "import json,sys; j=json.load(open(sys.argv[1])); assert len(j['resumed_runs']) == 1, j" "${csv%.csv}.json" \
  || fail "the sidecar keeps the first run's provenance"
echo "ok: sweep with oom rows and resume"

expect_failure "resume of another model" "another model" \
  "$STREAMBP" sweep seq --preset qwen3-small --seq 64 --methods checkpoint --check-seq 0 --resume "$csv"
# Found by fuzz_results_csv (tests/fuzz/regressions/results_csv): a seed cell that is not a number ended the resume
# with a bare "stoull", and a sidecar whose resumed_runs is not a list with nlohmann's type_error.
mkdir -p bad
python3 - "$csv" bad/seed.csv <<'PY' || fail "could not write bad/seed.csv"
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
rows[1][rows[0].index("seed")] = "seven"
csv.writer(open(sys.argv[2], "w", newline=""), lineterminator="\n").writerows(rows)
PY
expect_failure "resume CSV with a seed that is not a number" "bad/seed.csv: line 2: seed 'seven'" \
  "$STREAMBP" sweep seq --preset tiny --seq 64 --methods checkpoint --check-seq 0 --resume bad/seed.csv
cp "$csv" bad/runs.csv && echo '{"resumed_runs": "x"}' >bad/runs.json
expect_failure "resume with a broken sidecar" "bad/runs.csv: its sidecar .*runs.json has a \"resumed_runs\" that is not a list" \
  "$STREAMBP" sweep seq --preset tiny --seq 64 --methods checkpoint --check-seq 0 --resume bad/runs.csv
expect_exit_2 "bad length list" "--seq.*'x' is not a whole number" "$STREAMBP" sweep seq --preset tiny --seq 64,x --check-seq 0

# Table 6's toy: streamed equals standard bitwise in Eigen and LibTorch (exit 0), intermediates 1/D.
"$STREAMBP" toy --rows 300 --dim 32 --partitions 1,7,300 --repeats 1 --out toy >toy.txt 2>&1 || fail "toy failed:\n$(cat toy.txt)"
python3 - toy/toy-*.csv <<'PY' || fail "toy CSV"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
assert len(rows) == 6, rows
for r in rows:
    assert r["status"] == ("reference" if r["partitions"] == "1" else "passed"), r
    assert r["peak_bytes"] == r["model_peak_bytes"], r
    assert int(r["intermediate_bytes"]) == 2 * int(r["block_rows"]) * 32 * 4, r
PY
echo "ok: toy"
expect_failure "toy exactness bound" "2\^24" "$STREAMBP" toy --rows 100000 --dim 1024 --repeats 1

# Table 3's search: per method, the model's T* confirmed by a run that fits and one a step (2%) above that does not;
# with --optimizer the same for training steps (the optimizer's states and update in the budget and the model).
check_maxlen() {  # CSV budget optimizer-column-prefix
  python3 - "$@" <<'PY'
import csv, sys
file, budget, optimizer = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = list(csv.DictReader(open(file)))
for method in ("checkpoint", "streambp:layer_chunk=64,head_chunk=64"):
    mine = [r for r in rows if r["method"] == method]
    assert all(r["optimizer"].startswith(optimizer) and bool(r["optimizer"]) == bool(optimizer) for r in mine), mine
    best = [r for r in mine if r["role"] == "max"]
    over = [r for r in mine if r["role"] == "next"]
    assert len(best) == 1 and len(over) == 1, mine
    best, over = best[0], over[0]
    assert best["status"] != "oom" and int(best["peak_bytes"]) <= budget, best
    assert over["status"] == "oom" and over["peak_bytes"] == "", over
    T, T_over = int(best["seq_len"]), int(over["seq_len"])
    assert T < T_over <= max(T + 1, T * 1.02 + 1), (T, T_over)
    assert best["measured_max_seq"] == str(T) and abs(float(best["model_error"])) < 0.05, best
PY
}
"$STREAMBP" maxlen --preset tiny --budget-bytes 6000000 --methods "checkpoint;streambp:layer_chunk=64,head_chunk=64" \
  --out maxlen >maxlen.txt 2>&1 || fail "maxlen failed:\n$(cat maxlen.txt)"
check_maxlen maxlen/maxlen-*.csv 6000000 "" || fail "maxlen CSV:\n$(cat maxlen.txt)"
"$STREAMBP" maxlen --preset tiny --budget-bytes 4000000 --methods "checkpoint;streambp:layer_chunk=64,head_chunk=64" \
  --optimizer adamw:lr=1e-3 --optimizer-state-dtype fp32 --out maxlen-train >maxlen-train.txt 2>&1 \
  || fail "maxlen --optimizer failed:\n$(cat maxlen-train.txt)"
check_maxlen maxlen-train/maxlen-*.csv 4000000 "adamw:lr=0.001" || fail "maxlen --optimizer CSV:\n$(cat maxlen-train.txt)"
echo "ok: maxlen"

# Every checked-in reproduction lists its setting and commands.
for t in table1 table2 table3 table6 table7 fig3 fig5 memory-grid; do
  "$STREAMBP" reproduce $t --dry-run >repro.txt 2>&1 || fail "reproduce $t --dry-run:\n$(cat repro.txt)"
  grep -q "paper:" repro.txt && grep -q "command:" repro.txt || fail "reproduce $t prints no plan:\n$(cat repro.txt)"
done
expect_failure "unknown table" "table99" "$STREAMBP" reproduce table99
echo "ok: reproduce plans"

# Fig. 1/8: two steps' timeline per method; the categories add up to the live bytes, the peak matches the meter's.
"$STREAMBP" profile --preset tiny --seq 128 --methods "checkpoint;streambp:layer_chunk=32,head_chunk=32" --out prof \
  >prof.txt 2>&1 || fail "profile failed:\n$(cat prof.txt)"
python3 - prof/profile-*.csv <<'PY' || fail "profile files:\n$(cat prof.txt)"
import csv, sys
from pathlib import Path
summary = [p for p in sys.argv[1:] if not p.endswith(".timeline.csv")]
assert len(summary) == 1, sys.argv
rows = list(csv.DictReader(open(summary[0])))
assert [r["method"] for r in rows] == ["checkpoint", "streambp:layer_chunk=32,head_chunk=32"], rows
for r in rows:
    assert sum(int(v) for k, v in r.items() if k.startswith("at_peak: ")) == int(r["peak_bytes"]), r
    events = list(csv.reader(open(Path(summary[0]).parent / (r["timeline"] + ".timeline.csv"))))[1:]
    assert all(sum(map(int, e[3:])) == int(e[2]) for e in events)
    assert max(int(e[2]) for e in events) == int(r["peak_bytes"])
    assert (Path(summary[0]).parent / (r["timeline"] + ".trace.json")).exists()
PY
echo "ok: profile"

# project: the memory models at the paper's Table 3 settings, SFT/GRPO/DPO, with error bars from measured runs (here
# the small sweep above): every projection row of a measured method has its range (T* under the budget divided by
# the largest and by the smallest measured / modelled peak).
"$STREAMBP" project --errors out --error-presets tiny --out "$WORK/projection" > project.txt || fail "project failed:\n$(cat project.txt)"
grep -q "### grpo" project.txt && grep -q "### dpo" project.txt || fail "project printed no GRPO/DPO tables:\n$(cat project.txt)"
python3 - "$WORK/projection" <<'PY'
import csv, glob, sys
rows = list(csv.DictReader(open(glob.glob(sys.argv[1] + "/project-*.csv")[0])))
assert {r["objective"].split(":")[0] for r in rows} == {"sft", "grpo", "dpo"}, rows[0]
measured = [r for r in rows if r["error_runs"]]
assert measured, "no row has error bars"
for r in measured:
    low, T, high = int(r["model_max_seq_low"]), int(r["model_max_seq"]), int(r["model_max_seq_high"])
    # The bars are the model T under the measured/model ratios of the grid runs (within a few percent of 1): near T,
    # on either side of it (one-sided when every run erred the same way).
    assert 0 < low <= high and 0.9 * T <= low and high <= 1.1 * T, r
sft = [r for r in rows if r["objective"] == "sft" and r["method"] == "checkpoint"]
assert all(r["paper_max_seq"] for r in sft) and all(not r["paper_max_seq"] for r in rows if r["objective"] != "sft"), sft
print("ok: project with", len(measured), "rows with error bars")
PY
expect_failure "missing --errors folder" "no such folder" "$STREAMBP" project --errors "$WORK/nowhere" --out "$WORK/projection"
