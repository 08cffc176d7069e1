#!/usr/bin/env bash
# Runs one fuzz target for a bounded time, from its seed corpus plus what earlier runs in WORK found, and prints
# libFuzzer's statistics (executions, coverage, corpus). Exit 0 when the time ran out without a finding; otherwise
# the finding's report and the input that caused it (saved under BUILD/fuzz/findings/, to become a regression input
# in tests/fuzz/regressions/NAME/).
#   run_fuzz.sh BUILD NAME SECONDS [RUNS]   (BUILD: the sanitized tree; fuzz_seeds has written BUILD/fuzz/seeds)
# With RUNS the run is a fixed sequence (RUNS inputs, libFuzzer's -seed=1; SECONDS is not used), the same on every
# machine: CTest's runs (STREAMBP_FUZZ_RUNS each), which must not turn red by luck. Without, it searches for
# SECONDS with a fresh random seed: `make fuzz FUZZ_SECONDS=600`, the long runs.
set -uo pipefail
build=$1 name=$2 seconds=$3 runs=${4:-}
bin=$build/fuzz_$name work=$build/fuzz
seeds=$work/seeds corpus=$work/corpus/$name findings=$work/findings log=$work/logs/$name.log
# The format's words, which random mutation rarely spells: batches and shards are safetensors files.
case $name in
  safetensors* | batch) dict=safetensors ;;
  *) dict=$name ;;
esac
dict=$(dirname "$0")/dicts/$dict.dict
mkdir -p "$corpus" "$findings" "$work/logs"
args=(-print_final_stats=1 -artifact_prefix="$findings/$name-")
[ -f "$dict" ] && args+=(-dict="$dict")
# A fixed sequence is not capped by time (it would end early, and differently, on a loaded machine), and an input is
# hung only after 10 minutes: make test runs these at nice 19 beside the main tree's tests (run_suite.sh), where an
# input of a second can wait a minute. CTest's TIMEOUT bounds the whole run.
if [ -n "$runs" ]; then
  args+=(-runs="$runs" -seed=1 -timeout=600)
else
  args+=(-max_total_time="$seconds" -timeout=60)
fi
# One intra-op thread: the inputs are small, and ctest runs two targets at once on two cores.
OMP_NUM_THREADS=1 "$bin" "${args[@]}" "$corpus" "$seeds/$name" >"$log" 2>&1
rc=$?
done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1)
execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
bound="${seconds}s"
[ -n "$runs" ] && bound="$runs runs"
echo "fuzz $name: $bound, ${execs:-?} executions; ${done_line:-no DONE line}"
if [ $rc -ne 0 ]; then
  echo "FAIL: fuzz $name exited $rc; its report (full log: $log):"
  grep -vE '^(#[0-9]+[[:space:]]|[[:space:]]+NEW_FUNC)' "$log" | tail -40
fi
exit $rc
