# Verdicts and numbers the CLI makes of a NaN, an Inf or a 0 (issue #44):
# (a) `compare` fails a NaN or an Inf whichever file holds it (a NaN in REF printed -nan and passed, as did two equal
#     NaN files): in REF, in OTHER, in both, and with --baseline in REF (the fp64 oracle), in BASELINE and in OTHER.
#     Each exits 1 and names the tensor and the file; the clean files pass (the control).
# (b) `project --errors` refuses a measured/model ratio that is NaN, Inf or 0 (the budget is divided by it), exit 2
#     naming the file and the run; the unchanged file gives error bars (the control).
# Usage: cli_nonfinite.sh BINARY
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../support/cli_common.sh"

"$STREAMBP" run --preset tiny --method standard --batch 2 --seq 16 --dtype fp64 --seed 1 --save-grads std.safetensors \
  >run.log 2>&1 || fail "run:\n$(cat run.log)"
# Copies with one entry of model.norm.weight (fp64) set to NaN or +Inf, written into the file's bytes.
python3 - <<'PY'
import json, math, shutil, struct
with open("std.safetensors", "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    start = 8 + n + json.loads(f.read(n))["model.norm.weight"]["data_offsets"][0]
for name, value in (("nan", math.nan), ("inf", math.inf)):
    shutil.copy("std.safetensors", f"{name}.safetensors")
    with open(f"{name}.safetensors", "r+b") as f:
        f.seek(start + 3 * 8)
        f.write(struct.pack("<d", value))
PY

# expect_verdict_failure WHAT COMMAND... with PATTERNS (one per line) in $patterns: exit 1 (a verdict, not a usage
# error or a crash) and every pattern in the output.
expect_verdict_failure() {
  local what=$1 out status=0 pattern
  shift
  out=$("$@" 2>&1) || status=$?
  [[ $status -eq 1 ]] || fail "$what: exit $status, expected 1\n$out"
  while IFS= read -r pattern; do
    grep -qF -- "$pattern" <<<"$out" || fail "$what: no line saying \"$pattern\" in:\n$out"
  done <<<"$patterns"
  echo "ok: $what (exit 1): $(grep -m1 'problem' <<<"$out")"
}
norm="problem: tensor 'model.norm.weight' has 1"

"$STREAMBP" compare std.safetensors std.safetensors --rtol 1e-10 >clean.txt || fail "equal clean files failed:\n$(cat clean.txt)"
"$STREAMBP" compare std.safetensors std.safetensors --baseline std.safetensors --dtype fp32 >clean.txt ||
  fail "equal clean files failed the rule:\n$(cat clean.txt)"

patterns="$norm NaN entry in REF nan.safetensors"
expect_verdict_failure "NaN in REF" "$STREAMBP" compare nan.safetensors std.safetensors --rtol 1e-10
patterns="$norm NaN entry in OTHER nan.safetensors"
expect_verdict_failure "NaN in OTHER" "$STREAMBP" compare std.safetensors nan.safetensors --rtol 1e-10
patterns="$norm NaN entry in REF nan.safetensors
$norm NaN entry in OTHER nan.safetensors"
expect_verdict_failure "NaN in both (equal files)" "$STREAMBP" compare nan.safetensors nan.safetensors --rtol 1e-10
patterns="$norm Inf entry in REF inf.safetensors"
expect_verdict_failure "Inf in REF" "$STREAMBP" compare inf.safetensors std.safetensors --rtol 1e-10
patterns="$norm Inf entry in OTHER inf.safetensors"
expect_verdict_failure "Inf in OTHER" "$STREAMBP" compare std.safetensors inf.safetensors --rtol 1e-10

patterns="$norm NaN entry in REF nan.safetensors"
expect_verdict_failure "--baseline: NaN in REF" \
  "$STREAMBP" compare nan.safetensors std.safetensors --baseline std.safetensors --dtype fp32
patterns="$norm Inf entry in --baseline inf.safetensors"
expect_verdict_failure "--baseline: Inf in BASELINE" \
  "$STREAMBP" compare std.safetensors std.safetensors --baseline inf.safetensors --dtype fp32
patterns="$norm NaN entry in OTHER nan.safetensors"
expect_verdict_failure "--baseline: NaN in OTHER" \
  "$STREAMBP" compare std.safetensors nan.safetensors --baseline std.safetensors --dtype fp32

# (b)
grid=$(ls "$HERE"/../../results/grid/seq-*.csv | head -1)
mkdir -p bars && cp "$grid" bars/runs.csv
"$STREAMBP" project --errors bars --error-presets tiny >project.txt 2>&1 || fail "project --errors:\n$(cat project.txt)"
grep -q "runs)" project.txt || fail "project --errors gave no error bar:\n$(cat project.txt)"
for bad in nan inf 0; do
  python3 - "$grid" "bars/runs.csv" "$bad" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1], newline="")))
column = rows[0].index("peak_over_model")
row = next(r for r in rows[1:] if r[column])
row[column] = sys.argv[3]
csv.writer(open(sys.argv[2], "w", newline=""), lineterminator="\n").writerows(rows)
PY
  expect_exit_2 "project --errors with a peak_over_model of $bad" "bars/runs.csv: .* peak_over_model '$bad' is not a positive finite ratio" \
    "$STREAMBP" project --errors bars --error-presets tiny
done
