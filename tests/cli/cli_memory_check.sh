# Memory a step cannot have (issue #44): `run` refuses a step whose modelled peak is above what it may use before it
# starts (exit 3, status oom, the longest T that fits); --no-memory-check runs it anyway; a block the system refuses
# in the middle of a step is an oom naming its size (exit 3, never the usage error's 2); the console prints the budget
# as given, no time for a step that did not finish and one unit per column.
# ctest-timeout: 180
# ctest-cost: 55
source "$(dirname "$0")/../support/cli_common.sh"

run=(run --preset tiny --method checkpoint --dtype fp32 --threads 1)
# The budget: the model's peak at T = 32 (from --model-only), so that T = 64 cannot fit and T = 32 just does.
"$STREAMBP" "${run[@]}" --seq 32 --model-only --json model32.json >/dev/null
budget=$(python3 -c 'import json; print(json.load(open("model32.json"))["model_peak_bytes"])')

status=0
"$STREAMBP" "${run[@]}" --seq 64 --budget-bytes "$budget" --json refused.json >refused.txt 2>&1 || status=$?
[[ $status -eq 3 ]] || fail "a step over the budget by the model exited $status, expected 3:\n$(cat refused.txt)"
grep -q "^status    oom  (not run: the memory model's peak" refused.txt || fail "no refusal:\n$(cat refused.txt)"
grep -q "the longest sequence that fits is T = 32 " refused.txt || fail "no T that fits:\n$(cat refused.txt)"
grep -q "^budget    $budget bytes" refused.txt || fail "the budget is not the one given:\n$(cat refused.txt)"
! grep -q "^bp time\|^loss" refused.txt || fail "a step that did not run has a time or a loss:\n$(cat refused.txt)"
python3 - <<'PY'
import json
r = json.load(open("refused.json"))
c = r["memory_check"]
assert r["status"] == "oom" and r["error"].startswith("not run:"), (r["status"], r["error"])
assert c["fits"] is False and c["enforced"] is True and c["model_max_seq"] == 32, c
assert c["limited_by"].startswith("--budget-bytes"), c
for key in ["loss", "peak_bytes", "bp_seconds"]:
    assert r[key] is None, (key, r[key])
print("ok: refused before the step, T = 32 fits:", c["limited_by"])
PY

# --no-memory-check: the step runs and the meter judges it, naming the budget as given.
status=0
"$STREAMBP" "${run[@]}" --seq 64 --budget-bytes "$budget" --no-memory-check --json tried.json >tried.txt 2>tried.err ||
  status=$?
[[ $status -eq 3 ]] || fail "--no-memory-check over the budget exited $status, expected 3:\n$(cat tried.txt tried.err)"
grep -q "note: the step runs anyway (--no-memory-check)" tried.err || fail "no note:\n$(cat tried.err)"
grep -q "^status    oom  (CPU memory budget exceeded: .* > budget of $budget bytes" tried.txt ||
  fail "the meter's oom does not name the budget given:\n$(cat tried.txt)"
! grep -q "^bp time" tried.txt || fail "an unfinished step has a time:\n$(cat tried.txt)"
! grep -qE "^  phase .* [0-9]+\.[0-9]+ s " tried.txt || fail "an unfinished step's phases have times:\n$(cat tried.txt)"
python3 - <<'PY'
import json
r = json.load(open("tried.json"))
assert r["status"] == "oom" and r["memory_check"]["enforced"] is False, r["memory_check"]
assert r["phases"] and all(p["seconds"] is None for p in r["phases"]), r["phases"]
print("ok: --no-memory-check ran the step; the meter's oom names the budget")
PY

# One unit per column: the model's terms of a finished run.
"$STREAMBP" "${run[@]}" --seq 2000 --json fits.json >fits.txt
units=$(grep -E "^            " fits.txt | awk '{print $NF}' | sort -u)
[[ $(wc -l <<<"$units") -eq 1 ]] || fail "the terms' column mixes units ($units):\n$(cat fits.txt)"
echo "ok: one unit in the terms' column: $units"

# ulimit -v: what this process maps before its step differs between machines (CUDA libraries or not), so each limit
# below is that plus a margin, read from a record made under a limit too large to matter (1 TiB).
(ulimit -v 1073741824 && "$STREAMBP" "${run[@]}" --seq 32 --json mapped.json >/dev/null)
mapped_kib=$(python3 - <<'PY'
import json, re
[l] = [l for l in json.load(open("mapped.json"))["memory_check"]["limits"] if l["name"] == "ulimit -v"]
print((1073741824 * 1024 - l["left_bytes"]) // 1024)
PY
)
echo "this process maps $mapped_kib KiB before its step"

# 512 MiB more than that: standard BP's step at T = 60000 cannot fit (its model: 1018 MiB), and what runs before the
# step can. The margin is wide because ulimit -v counts address space, not bytes used: a thread's malloc arena maps
# 64 MiB at once, and with 128 MiB the kernel calibration before the check was refused under ctest (exit 3, no record).
# Standard BP, so that the step tried anyway fails in its forward, not after it.
margin_kib=524288
long=(run --preset tiny --method standard --dtype fp32 --threads 1 --seq 60000)
status=0
(ulimit -v $((mapped_kib + margin_kib)) && "$STREAMBP" "${long[@]}" --json ulimit.json >ulimit.txt 2>&1) || status=$?
[[ $status -eq 3 ]] || fail "a step over ulimit -v by the model exited $status, expected 3:\n$(cat ulimit.txt)"
python3 - <<'PY'
import json
c = json.load(open("ulimit.json"))["memory_check"]
assert c["fits"] is False and c["limited_by"].startswith("ulimit -v"), c
assert 2 <= c["model_max_seq"] < 60000, c
print("ok: refused under ulimit -v:", c["limited_by"], "; T that fits:", c["model_max_seq"])
PY

# train checks the same before its first step: a run whose step cannot fit stops at once (exit 3, the longest T that
# fits named, nothing written), and --no-memory-check trains anyway (here into the refused block: exit 3 too).
train=(train --preset tiny --method standard --dtype fp32 --threads 1 --seq 60000 --json train.json)
status=0
(ulimit -v $((mapped_kib + margin_kib)) && "$STREAMBP" "${train[@]}" >train.txt 2>&1) || status=$?
[[ $status -eq 3 ]] || fail "a training step over ulimit -v by the model exited $status, expected 3:\n$(cat train.txt)"
grep -qE "^streambp: out of memory: not run: .*ulimit -v.*the longest sequence that fits is T = [0-9]+ " train.txt ||
  fail "train's refusal does not name the limit and the T that fits:\n$(cat train.txt)"
! grep -q "^step 1/" train.txt && [[ ! -e train.json ]] || fail "a refused run trained or wrote:\n$(cat train.txt)"
echo "ok: train refused before its first step: $(grep -oE 'the longest sequence that fits is T = [0-9]+' train.txt)"
status=0
(ulimit -v $((mapped_kib + margin_kib)) && "$STREAMBP" "${train[@]}" --no-memory-check >tried_train.txt 2>&1) || status=$?
[[ $status -eq 3 ]] && ! grep -q "not run:" tried_train.txt ||
  fail "train --no-memory-check: exit $status, expected 3 from the refused block:\n$(cat tried_train.txt)"
echo "ok: train --no-memory-check trains into the limit: $(grep -m1 -oE 'out of memory: .{0,80}' tried_train.txt)"

# profile checks every method's step before the first one runs.
status=0
(ulimit -v $((mapped_kib + margin_kib)) &&
  "$STREAMBP" profile --preset tiny --methods "streambp;standard" --dtype fp32 --threads 1 --seq 60000 --out prof \
    >profile.txt 2>&1) || status=$?
[[ $status -eq 3 ]] && grep -qE "^streambp: out of memory: not run: standard: .*ulimit -v" profile.txt &&
  ! grep -q "step 1/" profile.txt || fail "profile over ulimit -v: exit $status:\n$(cat profile.txt)"
echo "ok: profile refused before any step: $(grep -oE 'not run: standard: .{0,60}' profile.txt)"

# The step tried anyway: the block the system refuses ends it as oom naming its size, exit 3.
status=0
(ulimit -v $((mapped_kib + margin_kib)) &&
  "$STREAMBP" "${long[@]}" --no-memory-check --json refused_block.json >block.txt 2>&1) || status=$?
[[ $status -eq 3 ]] || fail "a refused allocation exited $status, expected 3:\n$(cat block.txt)"
grep -qE "^status    oom  \(CPU out of memory: the system refused an allocation of [0-9]+ bytes" block.txt ||
  fail "the oom does not name the refused block:\n$(cat block.txt)"
python3 - <<'PY'
import json
r = json.load(open("refused_block.json"))
assert r["status"] == "oom" and "refused an allocation of" in r["error"], (r["status"], r["error"])
assert r["bp_seconds"] is None and r["peak_bytes"] is None, r
print("ok:", r["error"])
PY
