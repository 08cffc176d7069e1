#!/usr/bin/env bash
# `make test`'s body: build the main tree, test it while the sanitized tree builds, test that, and end with one
# summary of both.
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
# The sanitized tree compiles at nice 19 while the main tree's tests run: they leave a core idle for much of their
# time (python start-ups, ranks waiting on each other), and a nice-19 compiler takes little else. The tests labelled
# `alone` (the memory models against the meter: a peak depends on what else runs) wait until it has finished.
sanitized=${2:-}
bg_log=$(mktemp "${TMPDIR:-/tmp}/streambp-sanitize-build-XXXXXX.log")
bg_pid=
trap 'rm -f "$bg_log"' EXIT
bg_status=1
finish_background_build() {  # once: waits for it, prints its output, keeps its exit status in bg_status
  [[ -n $bg_pid ]] || return 0
  bg_status=0
  wait "$bg_pid" || bg_status=$?
  bg_pid=
  cat "$bg_log"
}
for tree in "$@"; do
  built=0
  if [[ $tree == "$1" ]]; then
    # The main tree's build first, alone: a compile error there is the first thing a developer wants to see.
    $make_cmd build && built=1
    if [[ -n $sanitized ]]; then
      echo "run_suite: building $sanitized/ at nice 19 while $tree/'s tests run (its output follows them)"
      nice -n 19 $make_cmd sanitize-build >"$bg_log" 2>&1 &
      bg_pid=$!
    fi
  else
    finish_background_build
    [[ $bg_status -eq 0 ]] && built=1
  fi
  if [[ $built -eq 0 ]]; then
    summary+=("$tree/: the build failed (its output is above)")
    status=1
    continue
  fi
  log=$tree/ctest.log
  if [[ $tree == "$1" ]]; then
    ctest --test-dir "$tree" --output-on-failure -j "$jobs" -LE alone 2>&1 | tee "$log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    finish_background_build
    ctest --test-dir "$tree" --output-on-failure -L alone 2>&1 | tee -a "$log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  else
    ctest --test-dir "$tree" --output-on-failure -j "$jobs" 2>&1 | tee "$log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  fi
  # ctest's closing lines, once per run: "100% tests passed, 0 tests failed out of 255", then the skipped ones listed
  # under "The following tests did not run:" as "  <n> - <name> (Skipped)".
  lines=$(grep -E '^[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' "$log")
  if [[ -z $lines ]]; then
    summary+=("$tree/: ctest printed no summary (see $log)")
    status=1
    continue
  fi
  failed=0 total=0
  while read -r line; do
    failed=$((failed + $(sed -E 's/.* ([0-9]+) tests? failed out of.*/\1/' <<<"$line")))
    total=$((total + $(sed -E 's/.*out of ([0-9]+).*/\1/' <<<"$line")))
  done <<<"$lines"
  skipped=$(grep -cE '^[[:space:]]*[0-9]+ - .*\((Skipped|Disabled)\)$' "$log")
  passed=$((total - failed - skipped))
  summary+=("$tree/: $passed passed, $failed failed, $skipped skipped (of $total; log: $log)")
  passed_total=$((passed_total + passed)) failed_total=$((failed_total + failed))
  skipped_total=$((skipped_total + skipped))
done
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
if [[ $status -eq 0 ]]; then echo "make test: both trees passed"; else echo "make test: FAILED (see above)"; fi
echo "tests: $passed_total passed, $failed_total failed, $skipped_total skipped"
exit $status
