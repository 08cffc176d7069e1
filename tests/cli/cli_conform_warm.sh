# Warm starts of conform's adapters (streambp_conform.warm, docs/conformance.md): a server imports torch, transformers
# and the model classes once and forks a worker per adapter run, in the caller's process group.
# (a) HF on three ci cases (fp64 GQA with a tied head, bf16 with HF as the baseline, a step of three micro-batches),
#     cold and then warm: the same statuses, worst tensors, errors and loss errors, digit for digit; the warm runs ran
#     in workers (the server's log names each of the four);
# (b) no server at the named socket: the adapter runs cold and passes;
# (c) a worker that hangs is ended by --timeout with the caller's process group and is gone afterwards; a worker that
#     dies of SIGKILL is reported as a cold adapter's death by SIGKILL is (the shell's status 137).
# Usage: cli_conform_warm.sh BINARY PYTHON
# ctest-needs-python
# ctest-timeout: 600
# ctest-cost: 75
source "$(dirname "$0")/../support/cli_common.sh"
PY=$2
SRC=$(cd "$(dirname "$0")/../.." && pwd)
export STREAMBP_PYTHON=$PY
three=(--impl hf --baseline hf --cases ci --only sft-gqa-qknorm-tied,sft-bf16,sft-micro3)

# (a)
"$STREAMBP" conform "${three[@]}" --out cold >cold.txt 2>&1 || fail "cold:\n$(cat cold.txt)"
warm_adapters "$PY"
"$STREAMBP" conform "${three[@]}" --out warm >warm.txt 2>&1 || fail "warm:\n$(cat warm.txt)"
python3 - cold/conform-*.csv warm/conform-*.csv <<'PY' || fail "cold and warm differ:\n$(cat cold.txt warm.txt)"
import csv, sys
cold, warm = ([{k: r[k] for k in ("case", "dtype", "status", "worst_tensor", "worst", "loss_rel_error")}
               for r in csv.DictReader(open(path))] for path in sys.argv[1:])
assert len(cold) == 3 and all(r["status"] == "passed" for r in cold), cold
assert cold == warm, (cold, warm)
PY
ran=$(grep -cE "worker [0-9]+ \(.*hf_adapter.py .*\) exited 0" "$WORK/warm.log" || true)
[[ $ran -eq 4 ]] || fail "the warm run's adapters (3 cases and the bf16 baseline) ran in $ran workers:\n$(cat "$WORK/warm.log")"
echo "ok: cold and warm give the same verdicts and errors; 4 runs in workers"
# The comparison's negative control: a server whose preload leaks a skewed loss into its workers fails the fp64 case.
PYTHONPATH=$SRC/verify/conform:$SRC/tests/support "$PY" -m streambp_conform serve "$WORK/skew.sock" torch transformers \
  warm_skew 2>skew.log &
skew=$!
for _ in $(seq 1200); do [[ -S $WORK/skew.sock ]] && break; sleep 0.1; done
status=0
STREAMBP_CONFORM_WARM=$WORK/skew.sock "$STREAMBP" conform --impl hf --cases ci --only sft-gqa-qknorm-tied --out skew \
  >skew.txt 2>&1 || status=$?
kill "$skew"
[[ $status -eq 1 ]] && grep -q "exited 0" skew.log || fail "a skewing server: exit $status\n$(cat skew.txt skew.log)"
echo "ok: a preload that leaks into the workers fails: $(grep -m1 -oE 'FAIL .{0,60}' skew.txt)"

# (b)
STREAMBP_CONFORM_WARM=$WORK/none.sock "$STREAMBP" conform --impl hf --cases ci --only sft-gqa-qknorm-tied --out none \
  >none.txt 2>&1 || fail "no server:\n$(cat none.txt)"
echo "ok: with no server the adapter runs cold"

# (c)
status=0
CONFORM_FAULTY_PID_FILE=$PWD/hang.pid "$STREAMBP" conform --impl "$PY $SRC/tests/support/conform_warm_faults.py hang" \
  --cases ci --only sft-gqa-qknorm-tied --timeout 3 --out hang >hang.txt 2>&1 || status=$?
[[ $status -eq 1 ]] && grep -q "timed out after 3 s" hang.txt || fail "a hanging worker: exit $status\n$(cat hang.txt)"
pid=$(cat hang.pid)
for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
! kill -0 "$pid" 2>/dev/null || fail "the hanging worker $pid outlived its case"
grep -qE "worker $pid \(.*conform_warm_faults.py hang .*\) killed by signal" "$WORK/warm.log" ||
  fail "the server did not see worker $pid end:\n$(cat "$WORK/warm.log")"
echo "ok: a hanging worker ends with its case"
status=0
"$STREAMBP" conform --impl "$PY $SRC/tests/support/conform_warm_faults.py kill" --cases ci --only sft-gqa-qknorm-tied \
  --out kill >kill.txt 2>&1 || status=$?
# the caller dies of the worker's signal, so conform's shell reports what it reports for a cold adapter: 128 + 9
[[ $status -eq 1 ]] && grep -q "exited with status 137" kill.txt || fail "a worker killed by SIGKILL: exit $status\n$(cat kill.txt)"
echo "ok: a worker's death by a signal is the adapter's"
