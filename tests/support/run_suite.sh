#!/usr/bin/env bash
# `make test`'s body: build the main tree and run its tests while the sanitized tree builds and runs its fuzz targets
# at nice 19; then the sanitized tree's other tests; then the main tree's `alone` tests with nothing beside them; and
# end with one summary of both trees.
# Each tree's ctest output is also kept in <tree>/ctest.log, so the summary can be read without scrolling back
# through the ~500 lines the sanitized tree prints after the main tree's own summary.
# Usage: run_suite.sh "<make command>" <jobs> <main tree> <sanitized tree>
set -uo pipefail
make_cmd=$1 jobs=$2
shift 2
summary=() status=0 passed_total=0 failed_total=0 skipped_total=0
# No test may time the bf16 GEMM paths (STREAMBP_GEMM_PROBE=off in every test's environment): a stored measurement
# that appears or changes during the suite is a test that timed them, and would change the paths of later processes.
gemm_store() { ls -l --time-style=+%s "${STREAMBP_CACHE:-$HOME/.cache/streambp}"/gemm-path-*.json 2>/dev/null; }
gemm_before=$(gemm_store)
# Tests write in temporary folders only: a file that appears in the checkout during the suite (not ignored by git) is
# a test writing where a user's results live.
new_files() { git -C "$(dirname "$0")/../.." status --porcelain --untracked-files=all 2>/dev/null | sed -n 's/^?? //p'; }
files_before=$(new_files)
# Phases, with the seconds since the start and the CPU seconds each took, so that a slow run can be read phase by
# phase: wall time depends on what else the machine runs, CPU time much less (a 2-core CI has 2 CPU-seconds a second).
started=$SECONDS
# cpu_seconds [PID]: user + system CPU seconds of the finished (waited-for) children of this shell, or of PID.
cpu_seconds() { awk -v hz="$(getconf CLK_TCK)" '{ printf "%.0f", ($16 + $17) / hz }' "/proc/${1:-$$}/stat"; }
cpu_mark=0 phases=()
# phase WHAT [CPU]: a line when WHAT is done; CPU: its CPU seconds when not this shell's children's since the last mark.
phase() {
  local now cpu
  now=$(cpu_seconds)
  cpu=${2:-$((now - cpu_mark))}
  [[ -n ${2:-} ]] || cpu_mark=$now
  echo "run_suite: $1 ($((SECONDS - started)) s; $cpu CPU-s)"
  phases+=("$(printf '%6s s %7s CPU-s  %s' "$((SECONDS - started))" "$cpu" "$1")")
}
# summarize <tree> <log> <ctest status...>: one summary line from ctest's closing lines in the log, "100% tests
# passed, 0 tests failed out of 255" once per ctest run, the skipped ones listed as "  <n> - <name> (Skipped)".
summarize() {
  local tree=$1 log=$2
  shift 2
  local rc
  for rc in "$@"; do [[ $rc -eq 0 ]] || status=1; done
  local lines
  lines=$(grep -E '^[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' "$log")
  if [[ -z $lines ]]; then
    summary+=("$tree/: ctest printed no summary (see $log)")
    status=1
    return
  fi
  local failed=0 total=0 line
  while read -r line; do
    failed=$((failed + $(sed -E 's/.* ([0-9]+) tests? failed out of.*/\1/' <<<"$line")))
    total=$((total + $(sed -E 's/.*out of ([0-9]+).*/\1/' <<<"$line")))
  done <<<"$lines"
  local skipped passed
  skipped=$(grep -cE '^[[:space:]]*[0-9]+ - .*\((Skipped|Disabled)\)$' "$log")
  passed=$((total - failed - skipped))
  summary+=("$tree/: $passed passed, $failed failed, $skipped skipped (of $total; log: $log)")
  # Where each failed test stopped, here at the end of the log where a reader (and CI's excerpt) looks: the CLI tests'
  # "FAIL: ..." lines (tests/support/cli_common.sh) and Catch2's "file:line: FAILED:", the first 20 of them.
  if ((failed > 0)); then
    local said
    said=$(grep -E '^FAIL: |: FAILED:$' "$log" | cut -c1-300 | head -20) || true
    [[ -z $said ]] || while read -r line; do summary+=("  $line"); done <<<"$said"
  fi
  passed_total=$((passed_total + passed)) failed_total=$((failed_total + failed))
  skipped_total=$((skipped_total + skipped))
}

main_tree=$1 sanitized=${2:-}
# The sanitized tree builds, and runs its fuzz targets, at nice 19 from the start: beside the main tree's build (whose
# precompiled header and links leave a core idle; on a new machine ~90 core-seconds) and then its tests (python
# start-ups, ranks waiting on each other), and nice-19 processes take little else. Only the fuzz targets: their fixed
# runs have no clock (tests/fuzz/run_fuzz.sh), whereas the unit tests' ranks give up on each other after 60 s, which a
# nice-19 process behind busy cores can exceed.
bg_dir= bg_pid=
if [[ -n $sanitized ]]; then
  bg_dir=$(mktemp -d "${TMPDIR:-/tmp}/streambp-sanitized-XXXXXX")
  trap 'rm -rf "$bg_dir"' EXIT
  echo "run_suite: building $sanitized/ and running its fuzz targets at nice 19 beside $main_tree/'s build and tests" \
    "(output follows them)"
  (
    me=$BASHPID  # this subshell (inside a $(...) BASHPID is that one's)
    if nice -n 19 $make_cmd sanitize-build >"$bg_dir/build.log" 2>&1; then
      cpu_seconds "$me" >"$bg_dir/build.cpu"
      echo "$((SECONDS - started))" >"$bg_dir/build.seconds"
      nice -n 19 ctest --test-dir "$sanitized" --output-on-failure -j "$jobs" -L fuzz >"$sanitized/ctest.log" 2>&1
      echo $? >"$bg_dir/fuzz.status"
      echo $(($(cpu_seconds "$me") - $(<"$bg_dir/build.cpu"))) >"$bg_dir/fuzz.cpu"
      echo "$((SECONDS - started))" >"$bg_dir/fuzz.seconds"
    fi
  ) &
  bg_pid=$!
fi
# The venv's oracle packages (transformers, peft, trl: the tests' python) install beside the main build, which needs
# torch only (make test installed it first): on a new machine that is half a minute the build's idle core takes.
venv_log=$(mktemp "${TMPDIR:-/tmp}/streambp-venv-XXXXXX")
$make_cmd -s venv >"$venv_log" 2>&1 &
venv_pid=$!
# The main tree's build first: a compile error there is the first thing a developer wants to see.
build_ok=1
$make_cmd build || build_ok=
venv_ok=1
wait "$venv_pid" || venv_ok=
cat "$venv_log"
rm -f "$venv_log"
if [[ -z $build_ok || -z $venv_ok ]]; then
  [[ -n $build_ok ]] || summary+=("$main_tree/: the build failed (its output is above)")
  [[ -n $venv_ok ]] || summary+=("the venv's oracle packages did not install (make venv; its output is above)")
  status=1
  if [[ -n $bg_pid ]]; then
    echo "run_suite: waiting for $sanitized/'s build and fuzz targets"
    wait "$bg_pid"
    cat "$bg_dir/build.log"
    [[ -f $bg_dir/fuzz.status ]] && cat "$sanitized/ctest.log"
  fi
else
  phase "$main_tree/ built (and the venv's oracle packages installed)"
  log=$main_tree/ctest.log
  ctest --test-dir "$main_tree" --output-on-failure -j "$jobs" -LE alone 2>&1 | tee "$log"
  main_rc=${PIPESTATUS[0]}
  phase "$main_tree/'s tests but the alone ones done"
  sanitized_rc=
  if [[ -n $sanitized ]]; then
    wait "$bg_pid"
    cpu_mark=$(cpu_seconds)  # the sanitized tree's CPU, now this shell's children's, is its own phases'
    cat "$bg_dir/build.log"
    if [[ -f $bg_dir/fuzz.status ]]; then
      echo "run_suite: $sanitized/ built at $(<"$bg_dir/build.seconds") s ($(<"$bg_dir/build.cpu") CPU-s, beside $main_tree/'s build and tests)"
      phases+=("$(printf '%6s s %7s CPU-s  %s' "$(<"$bg_dir/build.seconds")" "$(<"$bg_dir/build.cpu")" \
        "$sanitized/ built (beside the build and tests above, nice 19)")")
      cat "$sanitized/ctest.log"
      phases+=("$(printf '%6s s %7s CPU-s  %s' "$(<"$bg_dir/fuzz.seconds")" "$(<"$bg_dir/fuzz.cpu")" \
        "$sanitized/'s fuzz targets done")")
      echo "run_suite: $sanitized/'s fuzz targets done at $(<"$bg_dir/fuzz.seconds") s ($(<"$bg_dir/fuzz.cpu") CPU-s)"
      ctest --test-dir "$sanitized" --output-on-failure -j "$jobs" -LE fuzz 2>&1 | tee -a "$sanitized/ctest.log"
      rest_rc=${PIPESTATUS[0]}
      sanitized_rc="$(<"$bg_dir/fuzz.status") $rest_rc"
      phase "$sanitized/'s unit tests done"
    fi
  fi
  # The tests labelled `alone` (the memory models against the meter: a peak depends on what else runs) last, with
  # nothing beside them.
  ctest --test-dir "$main_tree" --output-on-failure -L alone 2>&1 | tee -a "$log"
  alone_rc=${PIPESTATUS[0]}
  phase "$main_tree/'s alone tests done"
  summarize "$main_tree" "$log" "$main_rc" "$alone_rc"
  if [[ -n $sanitized ]]; then
    if [[ -z $sanitized_rc ]]; then
      summary+=("$sanitized/: the build failed (its output is above)")
      status=1
    else
      summarize "$sanitized" "$sanitized/ctest.log" $sanitized_rc
    fi
  fi
fi
if [[ $(gemm_store) != "$gemm_before" ]]; then
  summary+=("a test measured the bf16 GEMM paths and stored them (a test's environment lacks STREAMBP_GEMM_PROBE=off)")
  status=1
fi
written=$(comm -13 <(sort <<<"$files_before") <(sort <<<"$(new_files)"))
if [[ -n $written ]]; then
  summary+=("tests wrote into the checkout (a test must write in a temporary folder): $(tr '\n' ' ' <<<"$written")")
  status=1
fi
echo
echo "make test summary"
printf '  %s\n' "${summary[@]}"
echo "  phases (seconds since the suite started, CPU seconds of each; apt and the venv before it are make's):"
printf '  %s\n' "${phases[@]}"
echo "  $(cpu_seconds) CPU-s in $((SECONDS - started)) s"
if [[ $status -eq 0 ]]; then echo "make test: both trees passed"; else echo "make test: FAILED (see above)"; fi
echo "tests: $passed_total passed, $failed_total failed, $skipped_total skipped"
exit $status
