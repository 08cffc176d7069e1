# `streambp conform` (issue #21) with implementations that need no Python packages:
# (a) the harness's own StreamBP through the protocol (verify/conform/streambp_adapter.py) passes every case of the
#     quick matrix, its micro-batch steps and sequence-parallel ranks through `streambp train` (the trainer's own
#     accumulation and reduction): fp64 against the oracle at 1e-10, fp32/bf16 against its own standard BP as the
#     baseline; the CSV has a row per case with provenance, status passed;
# (b) implementations that break the protocol are reported per case, naming the tensor or what happened, and the run
#     goes on to the next case (tests/support/conform_faulty_adapter.py): a crash, no output, a renamed tensor, a NaN, an
#     extra tensor, a flattened matrix (the shapes named), an fp64 case's gradients in fp32 (the dtype named), a hang
#     (--timeout), and a gradient off by 1e-6 relative (the fp64 judgement's negative control) or 10% (the
#     low-precision rule's); exit 1, and the results
#     folder holds only whole files; a NaN loss as Python's json.dumps writes it is named as such, and a loss and
#     gradients off together name the normaliser; a command that cannot run shows its command, the end of its output
#     and which python ran it (issue #44);
# (b') --junit FILE: one testcase per row of the CSV, failures naming the worst tensor and bar, N/A cases skipped with
#     their reason (tests/support/junit_check.py), written whole (temporary file, then rename).
# (c) bad input exits 2 naming it: an unknown dtype, a mistyped case set (the sets listed, the nearest suggested), a
#     malformed --cases file; a --cases file with one custom case (untied, MHA, no qk-norm, T = 50, chunks 7/5) passes;
# (d) the temporary folder goes however a run ends (passed, failed, Ctrl-C: exit 130, the implementation stopped);
#     nothing stays in $TMPDIR (issue #44).
# ctest-timeout: 300
# ctest-cost: 95
source "$(dirname "$0")/../support/cli_common.sh"
HERE=$(cd "$(dirname "$0")" && pwd)
ours=(python3 "$HERE/../../verify/conform/streambp_adapter.py" --streambp "$STREAMBP")
impl="${ours[*]}"

rows() {  # rows CSV STATUS: how many rows have this status
  python3 -c "import csv,sys; print(sum(r['status'] == sys.argv[2] for r in csv.DictReader(open(sys.argv[1]))))" "$1" "$2"
}

# (a)
"$STREAMBP" conform --impl "$impl" --baseline "$impl --method standard" --out ok --junit ok/report.xml >ok.txt 2>ok.log ||
  fail "the harness's own StreamBP does not conform:\n$(cat ok.txt ok.log)"
csv=$(ls ok/conform-*.csv)
[[ $(rows "$csv" passed) -eq 18 && $(rows "$csv" failed) -eq 0 ]] || fail "quick matrix rows:\n$(cat "$csv")"
python3 "$HERE/../support/junit_check.py" ok/report.xml "$csv" || fail "--junit:\n$(cat ok/report.xml)"
grep -q "18 of 18 case(s) passed; results" ok.txt ||
  fail "no summary:\n$(cat ok.txt)"
echo "ok: StreamBP through the protocol passes the quick matrix"

# (b)
check_faulty() {  # check_faulty MODE PATTERN [conform flags]: every selected case fails, naming PATTERN
  local mode=$1 pattern=$2 status=0
  shift 2
  rm -rf "r-$mode" "w-$mode"  # a mode checked twice: its second run's CSV alone
  "$STREAMBP" conform --impl "python3 $HERE/../support/conform_faulty_adapter.py $mode $STREAMBP" --baseline "$impl --method standard" \
    --out "r-$mode" --work "w-$mode" --junit "r-$mode/report.xml" "$@" >"$mode.txt" 2>"$mode.log" || status=$?
  [[ $status -eq 1 ]] || fail "$mode: exit $status, expected 1\n$(cat "$mode.txt" "$mode.log")"
  local csv total
  csv=$(ls "r-$mode"/conform-*.csv)
  total=$(($(rows "$csv" passed) + $(rows "$csv" failed)))
  [[ $(rows "$csv" failed) -eq $total && $total -ge 2 ]] || fail "$mode: not every case failed:\n$(cat "$csv")"
  [[ $(grep -cE -- "$pattern" "$mode.txt") -ge $total ]] || fail "$mode: '$pattern' not named per case:\n$(cat "$mode.txt")"
  [[ -z $(find "r-$mode" -name '*.tmp*') ]] || fail "$mode: half-written results: $(ls -a "r-$mode")"
  python3 "$HERE/../support/junit_check.py" "r-$mode/report.xml" "$csv" >/dev/null || fail "$mode: --junit"
  echo "ok: $mode fails all $total cases: $(grep -m1 -oE -- "$pattern.{0,60}" "$mode.txt")"
}
# Each fault on two cases (it must fail each, named per case): the modes are the adapter's, not the cases', and the
# quick matrix's passing run above already walks every case through the protocol.
sft=(--only sft-gqa-qknorm-tied,sft-mha-bias-untied)
check_faulty crash "exited with status 1: RuntimeError: the implementation crashed" "${sft[@]}"
check_faulty nothing "wrote no grads.safetensors" "${sft[@]}"
check_faulty rename "tensor '[^']+' missing; unexpected tensor '[^']+\.renamed'" "${sft[@]}"
check_faulty nan "has 1 non-finite entries" "${sft[@]}"
check_faulty extra "unexpected tensor 'model.not_a_parameter'" "${sft[@]}"
check_faulty shape "tensor '[^']+' has shape \[[0-9]+\], expected \[[0-9]+, [0-9]+\]" "${sft[@]}"
check_faulty fp32 "grads.safetensors: [0-9]+ of [0-9]+ tensor\(s\) not in the case's dtype float64: '[^']+' is float32" "${sft[@]}"
check_faulty hang "timed out after 2 s \(--timeout\): loading the model" --only grpo-beta0.04-grpo-token,dpo-3pairs-ls0.1 --timeout 2
! grep -q "Loading weights" hang.txt || fail "a progress bar quoted as the last words:\n$(cat hang.txt)"
"$STREAMBP" conform --help | grep -qE -- "--timeout [A-Z:]+=300" || fail "conform --help: no default for --timeout"
check_faulty perturb "FAIL +[0-9.e+-]+ model\." --only grpo-beta0.04-grpo-token,dpo-3pairs-ls0.1,grpo-micro2
# A failing line names its bar, so that a reader knows how far off the implementation is.
grep -qE "FAIL .*normwise error [0-9.e+-]+ > the fp64 bar 1e-10" perturb.txt || fail "no fp64 bar:\n$(cat perturb.txt)"
check_faulty perturb "FAIL +[0-9.e+-]+ model\." --dtypes fp32,bf16
grep -qE "FAIL .*x the low-precision rule's bar" perturb.txt || fail "no low-precision bar:\n$(cat perturb.txt)"
# The JUnit check's negative control: a report whose failure names another tensor than the CSV's is rejected.
python3 -c "import re, sys; open('tampered.xml', 'w').write(re.sub(r\"worst tensor &apos;[^&]+&apos;\", \"worst tensor &apos;x&apos;\", open(sys.argv[1]).read()))" r-perturb/report.xml
! python3 "$HERE/../support/junit_check.py" tampered.xml r-perturb/conform-*.csv >/dev/null 2>&1 ||
  fail "junit_check.py accepts a report naming another tensor than the CSV"
check_faulty nan-loss "result.json: the loss is NaN" "${sft[@]}"
check_faulty half-count "loss .* off too: usually the normaliser" "${sft[@]}"
# A loss that shifts its labels inside each head tile: exact away from the tiles' boundaries, wrong at them, named.
check_faulty chunk-shift "the error sits next to the head tile boundaries \(every 8 positions\)" "${sft[@]}"
! grep -q "off too: usually the normaliser" chunk-shift.txt || fail "chunk-shift: the normaliser blamed:\n$(cat chunk-shift.txt)"
# --judge DIR/CASE: the kept case judged again as it is, after a "fix" (the right adapter), and with the bug still in.
kept=w-chunk-shift/sft-gqa-qknorm-tied
[[ -f $kept/case.json ]] || fail "--work kept no failing case: $(ls w-chunk-shift)"
"$STREAMBP" conform --impl "$impl" --judge "$kept" --out rejudged >rejudged.txt 2>&1 ||
  fail "--judge after the fix:\n$(cat rejudged.txt)"
grep -q "1 of 1 case(s) passed" rejudged.txt && [[ -f $kept/case.json ]] || fail "--judge:\n$(cat rejudged.txt)"
status=0
"$STREAMBP" conform --impl "python3 $HERE/../support/conform_faulty_adapter.py chunk-shift $STREAMBP" --judge "$kept" \
  --out rejudged-bug >rejudged-bug.txt 2>&1 || status=$?
[[ $status -eq 1 ]] && grep -q "tile boundaries" rejudged-bug.txt || fail "--judge, the bug kept: exit $status\n$(cat rejudged-bug.txt)"
sed -i 's/"case": "sft-gqa-qknorm-tied"/"case": "sft-gqa-qknorm-tied", "edited": 1/' "$kept/case.json"
expect_exit_2 "--judge on an edited case.json" "case.json differs from case 'sft-gqa-qknorm-tied'" \
  "$STREAMBP" conform --impl "$impl" --judge "$kept"
echo "ok: --judge re-judges a kept case: $(grep -m1 "case(s) passed" rejudged.txt)"

# A command that cannot run (here a python without the module it imports) is shown once: its command line, the end of
# its output, and which python ran it beside the harness's own.
echo '[{"name": "one", "seq": 9, "batch": 2}]' >one.json
status=0
"$STREAMBP" conform --impl "python3 -c 'import streambp_no_such_module'" --cases one.json --out nomodule \
  >nomodule.txt 2>nomodule.log || status=$?
[[ $status -eq 1 ]] || fail "a python without the module: exit $status\n$(cat nomodule.txt nomodule.log)"
grep -q "the implementation failed (exited with status 1): python3 -c 'import streambp_no_such_module' '/" nomodule.txt &&
  grep -q "    ModuleNotFoundError: No module named 'streambp_no_such_module'" nomodule.txt &&
  grep -qE "^  python3 is /.*python3" nomodule.txt || fail "no command, output or python named:\n$(cat nomodule.txt)"
# The harness's python is offered only to a command whose python has no torch: a user's own venv is theirs.
has_torch() { "$@" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)'; }
offered="the harness's python (torch, transformers, peft) is"
if [[ -n ${2:-} && $(command -v python3) != "$2" ]]; then
  if has_torch python3; then
    ! grep -qF "$offered" nomodule.txt || fail "the harness's python offered to a python with torch:\n$(cat nomodule.txt)"
  else
    grep -qF "$offered $2: --impl \"$2 -c 'import" nomodule.txt ||
      fail "the harness's python not offered:\n$(cat nomodule.txt)"
  fi
  mkdir -p fake-torch/torch && touch fake-torch/torch/__init__.py  # a python3 that has a torch: the user's venv
  PYTHONPATH=$PWD/fake-torch "$STREAMBP" conform --impl "python3 -c 'import streambp_no_such_module'" \
    --cases one.json --out withtorch >withtorch.txt 2>&1 && fail "a python without the module passed"
  ! grep -qF "$offered" withtorch.txt || fail "the harness's python offered to a python with torch:\n$(cat withtorch.txt)"
fi
grep -q -- "--work DIR keeps them" nomodule.txt || fail "no word on keeping the failing cases:\n$(cat nomodule.txt)"
echo "ok: a command that cannot run: $(grep -m1 "python3 is" nomodule.txt)"

# (c)
expect_exit_2 "an unknown dtype" "fp16x" "$STREAMBP" conform --impl true --dtypes fp16x
expect_exit_2 "a mistyped case set" "quik: neither a case set \(ci, quick, full, survey, rl, rl-verl\) nor a file \(did you mean quick\?\)" \
  "$STREAMBP" conform --impl true --cases quik
expect_exit_2 "a missing cases file" "nope.json: neither a case set \(ci, quick, full, survey, rl, rl-verl\) nor a file$" \
  "$STREAMBP" conform --impl true --cases nope.json
"$STREAMBP" conform --help | grep -q -- "--cases.*quick, full, survey, rl (whole RL steps.*) or rl-verl" || fail "conform --help lists no case sets"
echo '[{"name": "x", "sequence": 9}]' >bad.json
expect_exit_2 "an unknown key" "case 0: unknown key 'sequence'" "$STREAMBP" conform --impl true --cases bad.json
cat >mine.json <<'JSON'
[{"name": "custom-untied-mha", "preset": "tiny-mha", "qk_norm": false, "tie_word_embeddings": false, "seq": 50,
  "batch": 2, "layer_chunk": 7, "head_chunk": 5, "objective": "grpo:beta=0.04,loss_type=bnpo", "group": 2}]
JSON
"$STREAMBP" conform --impl "$impl" --cases mine.json --out mine >mine.txt 2>mine.log ||
  fail "a custom case:\n$(cat mine.txt mine.log)"
grep -q "custom-untied-mha .* PASS" mine.txt || fail "custom case not run:\n$(cat mine.txt)"
echo "ok: a --cases file with a custom case"

# (d) Ctrl-C while the implementation runs: it is stopped, the run exits 130 and its temporary folder goes.
export CONFORM_FAULTY_PID_FILE=$PWD/hang.pid
"$STREAMBP" conform --impl "python3 $HERE/../support/conform_faulty_adapter.py hang $STREAMBP" --cases one.json \
  --out interrupted >interrupted.txt 2>interrupted.log &
conform=$!
for _ in $(seq 600); do [[ -s hang.pid ]] && break; sleep 0.1; done
[[ -s hang.pid ]] || fail "the hanging implementation never started:\n$(cat interrupted.log)"
kill -INT "$conform"
status=0
wait "$conform" || status=$?
[[ $status -eq 130 ]] || fail "Ctrl-C: exit $status, expected 130\n$(cat interrupted.txt interrupted.log)"
alive() {  # alive PID: running, not yet a zombie (the group's SIGKILL lands, and its reaper comes, a moment later)
  [[ -e /proc/$1/stat && $(cut -d' ' -f3 "/proc/$1/stat") != Z ]]
}
for _ in $(seq 100); do alive "$(cat hang.pid)" || break; sleep 0.1; done
! alive "$(cat hang.pid)" || fail "Ctrl-C left the implementation running (pid $(cat hang.pid))"
grep -q "interrupted (Ctrl-C) after 0 of 1 case(s)" interrupted.txt || fail "Ctrl-C not reported:\n$(cat interrupted.txt)"
echo "ok: Ctrl-C stops the implementation and exits 130"
# Every run above without --work (passed, failed, interrupted) removed its temporary folder.
[[ -z $(ls -A "$TMPDIR") ]] || fail "left in \$TMPDIR: $(ls -A "$TMPDIR")"
echo "ok: nothing left in \$TMPDIR"
