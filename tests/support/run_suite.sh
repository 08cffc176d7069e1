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
# time (python start-ups, ranks waiting on each other, the last long test alone), and a nice-19 compiler takes only
# that idle time, so the tests see the machine they would have seen without it.
background_build() {
  local log=$1
  shift
  nice -n 19 $make_cmd "$@" >"$log" 2>&1
}
sanitized=${2:-}
bg_log=$(mktemp "${TMPDIR:-/tmp}/streambp-sanitize-build-XXXXXX.log")
bg_pid=
trap 'rm -f "$bg_log"' EXIT
for tree in "$@"; do
  if [[ $tree == "$1" ]]; then
    # The main tree's build first, alone: a compile error there is the first thing a developer wants to see.
    built=0
    $make_cmd build && built=1
    if [[ -n $sanitized ]]; then
      echo "run_suite: building $sanitized/ at nice 19 while $tree/'s tests run (its output: $bg_log)"
      background_build "$bg_log" sanitize-build &
      bg_pid=$!
    fi
  else
    built=0
    if wait "$bg_pid"; then built=1; fi
    bg_pid=
    cat "$bg_log"
  fi
  if [[ $built -eq 0 ]]; then
    summary+=("$tree/: the build failed (its output is above)")
    status=1
    continue
  fi
  log=$tree/ctest.log
  ctest --test-dir "$tree" --output-on-failure -j "$jobs" 2>&1 | tee "$log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  # ctest's closing lines: "100% tests passed, 0 tests failed out of 255", then the skipped ones listed under
  # "The following tests did not run:" as "  <n> - <name> (Skipped)".
  line=$(grep -E '^[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' "$log" | tail -n 1)
  if [[ -z $line ]]; then
    summary+=("$tree/: ctest printed no summary (see $log)")
    status=1
    continue
  fi
  failed=$(sed -E 's/.* ([0-9]+) tests? failed out of.*/\1/' <<<"$line")
  total=$(sed -E 's/.*out of ([0-9]+).*/\1/' <<<"$line")
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
