# A CLI test that stops on a failing command names it (cli_common.sh's ERR trap): script, line, exit code and the
# command, so that a failure in CI's excerpt says where it happened (make test's summary repeats these lines). A
# failure inside a check (|| fail, expect_failure, if, !) stays silent: only the command that stopped the test speaks.
common=$(realpath "$(dirname "$0")/../support/cli_common.sh")  # before it moves into its temporary folder
source "$common"

cat > stops.sh <<EOF
source "$common" "\$1"
false || true
if false; then :; fi
! false
expect_failure "an unknown flag" "no-such-flag" "\$STREAMBP" run --no-such-flag >/dev/null
ls /nonexistent-streambp-path
echo "not reached"
EOF
status=0
out=$(bash stops.sh "$STREAMBP" 2>&1) || status=$?
[[ $status -eq 2 ]] || fail "a script stopped by ls (exit 2) exited $status:\n$out"
! grep -q "not reached" <<<"$out" || fail "the script went on after its failing command:\n$out"
[[ $(grep -c '^FAIL: ' <<<"$out") -eq 1 ]] || fail "expected one FAIL line (the ls), got:\n$out"
grep -qE '^FAIL: stops\.sh:6: exit 2: ls /nonexistent-streambp-path$' <<<"$out" \
  || fail "the FAIL line does not name line 6's ls:\n$out"
echo "ok: $(grep '^FAIL: ' <<<"$out")"
