# Sourced by the CLI tests (cli_*.sh BINARY): strict mode, the binary as $STREAMBP, the current directory a fresh
# temporary folder removed on exit, $TMPDIR inside it (whatever the programs under test leave there goes too), and the
# helpers below.
set -Eeuo pipefail
# A command that fails outside a check stops the test (set -e) without a word of its own; this line names it, its
# script line and exit code (make test's summary repeats every "FAIL:" line, so a failure in CI's log says where it
# happened). -E hands the trap to functions and subshells.
trap 'echo "FAIL: ${BASH_SOURCE[0]##*/}:$LINENO: exit $?: $BASH_COMMAND" >&2' ERR
STREAMBP=$(realpath "$1")
WORK=$(mktemp -d "${TMPDIR:-/tmp}/sbp_cli_XXXXXX")
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
export TMPDIR=$WORK/tmp
mkdir "$TMPDIR"

fail() {
  printf 'FAIL: %b\n' "$*" >&2
  exit 1
}

# expect_failure WHAT PATTERN COMMAND...: COMMAND must exit non-zero and say something matching the extended regex
# PATTERN (stdout and stderr together): the exit code is the verdict, the message tells the user what to fix.
expect_failure() {
  local what=$1 pattern=$2 out status=0
  shift 2
  out=$("$@" 2>&1) || status=$?
  [[ $status -ne 0 ]] || fail "$what: exited 0\n$out"
  # 128 + N is death by signal N: a crash is not a clean rejection.
  [[ $status -lt 128 ]] || fail "$what: killed by a signal (exit $status)\n$out"
  grep -qE -- "$pattern" <<<"$out" || fail "$what: no message matching '$pattern' in:\n$out"
  echo "ok: $what (exit $status): $(grep -E -m1 -- "$pattern" <<<"$out")"
}

# expect_exit_2 WHAT PATTERN COMMAND...: as expect_failure, and the exit code must be 2 (bad input), its message of
# that class ("error:", never "internal error": a bug exits 70, experiments/exit_status.h).
expect_exit_2() {
  local what=$1 pattern=$2 out status=0
  shift 2
  out=$("$@" 2>&1) || status=$?
  [[ $status -eq 2 ]] || fail "$what: exit $status, expected 2\n$out"
  grep -q "internal error" <<<"$out" && fail "$what: exit 2 with an internal error's message:\n$out"
  grep -qE "(^|: )error: " <<<"$out" || fail "$what: exit 2 without an input error's message ('error: ...'):\n$out"
  grep -qE -- "$pattern" <<<"$out" || fail "$what: no message matching '$pattern' in:\n$out"
  echo "ok: $what (exit 2): $(grep -E -m1 -- "$pattern" <<<"$out")"
}

# expect_ranks_disagree WHAT PATTERN FLAG VALUE0 VALUE1 ARGS...: two ranks of `train ARGS` started by hand as the
# launcher starts them (its environment, a FileStore in ./store), rank r given FLAG VALUEr: both must exit 2, rank 0
# saying something matching PATTERN (the setting the ranks disagree on).
expect_ranks_disagree() {
  local what=$1 pattern=$2 flag=$3 status r
  local -a values=("$4" "$5") pids
  shift 5
  mkdir -p store
  for r in 0 1; do
    STREAMBP_RANK=$r STREAMBP_WORLD_SIZE=2 STREAMBP_STORE=$PWD/store/$flag "$STREAMBP" train "$@" "$flag" "${values[$r]}" \
      >"disagree$r.log" 2>&1 &
    pids[r]=$!
  done
  for r in 0 1; do
    status=0
    wait "${pids[r]}" || status=$?
    [[ $status -eq 2 ]] || fail "$what: rank $r exited $status, expected 2\n$(cat "disagree$r.log")"
  done
  grep -qE -- "$pattern" disagree0.log || fail "$what: no message matching '$pattern' in:\n$(cat disagree0.log)"
  echo "ok: $what (exit 2): $(grep -E -m1 -- "$pattern" disagree0.log)"
}

# ctrl_c PID LOG: a user's Ctrl-C, sent once the process catches SIGINT (its bit in /proc/PID/status's SigCgt; a
# background job ignores SIGINT until then). `train` starts catching just before its first step, so the signal lands
# in step 1 (or before it) whatever the machine's speed, instead of racing a progress line.
ctrl_c() {
  local pid=$1 log=$2
  catches_sigint() {
    local mask
    mask=$(awk '/^SigCgt:/ { print $2 }' "/proc/$1/status" 2>/dev/null) && [[ -n $mask ]] && (((16#$mask >> 1) & 1))
  }
  for _ in $(seq 6000); do catches_sigint "$pid" && break; kill -0 "$pid" 2>/dev/null || break; sleep 0.01; done
  catches_sigint "$pid" || { kill -9 "$pid" 2>/dev/null || true; fail "the run never caught SIGINT:\n$(cat "$log")"; }
  kill -INT "$pid"
}

# warm_adapters PYTHON [MODULE ...]: the conform adapters that call streambp_conform.warm.delegate() (the shipped HF
# ones) run in workers forked from one server in PYTHON, its imports (the MODULEs, else the server's default ones) done
# once instead of once per case (cli_conform_warm.sh: the same verdicts as cold). The server stops when the test ends;
# its log is $WORK/warm.log.
warm_adapters() {
  local sock=$WORK/warm.sock
  (( ${#sock} < 100 )) || sock=$(mktemp -u /tmp/sbp_warm_XXXXXX.sock)  # a socket's path has at most 107 bytes
  PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../verify/conform" && pwd)${PYTHONPATH:+:$PYTHONPATH}" \
    "$1" -m streambp_conform serve "$sock" "${@:2}" 2>"$WORK/warm.log" &
  WARM_PID=$!
  trap 'kill "$WARM_PID" 2>/dev/null; wait "$WARM_PID" 2>/dev/null; rm -rf "$WORK"' EXIT
  for _ in $(seq 1200); do
    [[ -S $sock ]] && break
    kill -0 "$WARM_PID" 2>/dev/null || fail "the warm server stopped:\n$(cat "$WORK/warm.log")"
    sleep 0.1
  done
  [[ -S $sock ]] || fail "the warm server did not start within 120 s:\n$(cat "$WORK/warm.log")"
  export STREAMBP_CONFORM_WARM=$sock
}
