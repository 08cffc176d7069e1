#!/bin/bash
# The user's side of `streambp conform` in CI (issue #47, docs/conform-in-ci.md), with the page's own code and commands,
# in a venv with another torch than the harness's (2.13.0 CPU; cached in ~/.cache/streambp, as the survey's venvs):
#   - the package's own checks, mostly against a fake harness (tests/support/conform_plugin_checks.py: duplicate case
#     names, objectives, sessions that judge nothing, script paths, --streambp-work, collected counts, --streambp-cases,
#     binary errors, JUnit classnames, warm servers of another environment, result.json, streambp_conform.hf);
#   - the page's two code blocks (the adapter, the pytest marker) are tests/conform_sample's adapter.py and
#     test_gradients.py; with its my_library.py (a chunked loss) they are the user's tests/conform;
#   - the page's GitHub job commands (pip install ./verify/conform, pytest --streambp-warm --junitxml) from the user's
#     repository root: the right loss passes the ci set's SFT cases, fp64 and bf16 (whose hf baseline runs cold, in
#     the harness's python), LoRA and the micro-batch step skipped with their reasons, the adapter runs warm and the
#     JUnit file has each case under conform's classname;
#   - the same loss shifting each chunk after the split (SAMPLE_LOSS=chunk-shift) fails: STREAMBP, -k, and -x stopping
#     at the first case, the tensor and the tile boundary named in pytest's output and the JUnit file, no traceback;
#   - a session of N/A cases only fails, and passes with --streambp-allow-none-judged;
#   - a missing binary is one error naming --streambp and the docs page.
# Usage: cli_conform_pytest.sh BINARY PYTHON
# ctest-needs-python
# ctest-timeout: 900
# ctest-cost: 180
SRC=$(cd "$(dirname "$0")/../.." && pwd)
source "$SRC/tests/support/cli_common.sh"
CACHE=${STREAMBP_CACHE:-$HOME/.cache/streambp}
VENV=$CACHE/venv-conform-torch-2.13.0
REQUIREMENTS="torch==2.13.0 transformers==5.18.0 pytest==9.2.0 setuptools"
export PYTHONDONTWRITEBYTECODE=1  # nothing written into the checkout's sample project

# The venv, made once (a stamp holds what from; a lock for two runs at once): the cold path of the docs' CI job.
mkdir -p "$CACHE"
(
  flock 9
  if [[ $(cat "$VENV/.stamp" 2>/dev/null) != "$REQUIREMENTS" ]]; then
    python3 -m venv --clear "$VENV"
    # shellcheck disable=SC2086  # the requirements are words
    "$VENV/bin/python" -m pip install --quiet $REQUIREMENTS >"$WORK/venv.log" 2>&1 ||
      fail "pip install $REQUIREMENTS:\n$(tail -5 "$WORK/venv.log")"
    echo "$REQUIREMENTS" >"$VENV/.stamp"
  fi
) 9>"$CACHE/.venv-conform.lock"
PY=$VENV/bin/python
[[ $("$PY" -c "import torch; print(torch.__version__)") == 2.13.0* ]] || fail "the venv's torch is not 2.13.0"

# The package's own behaviour: one python, each pytest session in it in-process (the checkout's package).
start=$SECONDS
PYTHONPATH=$SRC/verify/conform CONFORM_OTHER_PYTHON=$2 "$PY" -m pytest -p pytester -p no:cacheprovider -q \
  "$SRC/tests/support/conform_plugin_checks.py" >checks.txt 2>&1 || fail "the package's checks:\n$(cat checks.txt)"
echo "ok: the package's checks ($((SECONDS - start)) s): $(tail -1 checks.txt)"

# The page's code blocks, as the page has them, are the sample's files.
page=$SRC/docs/conform-in-ci.md
mkdir blocks
awk -v dir=blocks '
  match($0, /^<!-- tests\/conform_sample\/[^:]+:/) { file = substr($0, 27, RLENGTH - 27); next }
  file != "" && /^```/ { if (inside) { close(out); file = ""; inside = 0 } else { inside = 1; out = dir "/" file; printf "" > out }; next }
  inside { print > out }' "$page"
[[ $(ls blocks) == $'adapter.py\ntest_gradients.py' ]] || fail "$page: the blocks marked for tests/conform_sample: $(ls blocks)"
for block in blocks/*; do
  diff -u "$block" "$SRC/tests/conform_sample/${block#blocks/}" >&2 ||
    fail "$page: its block for ${block#blocks/} is not tests/conform_sample/${block#blocks/} (the diff above)"
done

# A user's project as the page's jobs see it after the harness build: the harness checked out in streambp/ (here its
# package and built binary), the sample with the page's blocks as tests/conform, the venv, a requirements.txt.
mkdir -p project/streambp/ci-build project/streambp/verify project/tests
cp -r "$SRC/verify/conform" project/streambp/verify/  # pip builds in the source folder: the checkout stays clean
ln -s "$STREAMBP" project/streambp/ci-build/streambp
cp -r "$SRC/tests/conform_sample" project/tests/conform
cp blocks/* project/tests/conform/
ln -s "$VENV" project/.venv
printf 'torch==2.13.0\ntransformers==5.18.0\n' >project/requirements.txt
# The GitHub job's commands after its venv is made, as docs/conform-in-ci.md has them: the page cannot rot.
sed -n '/^### GitHub Actions/,/^### GitLab/p' "$page" | grep -E '^ +(- run: )?\.venv/bin/' |
  sed -E 's/^ +(- run: )?//' >project/commands.sh
[[ $(grep -c "pip install" project/commands.sh) -eq 1 && $(grep -c "pytest" project/commands.sh) -eq 2 ]] ||
  fail "$page: no '.venv/bin/pip install' and '.venv/bin/pytest' lines in the GitHub job:\n$(cat project/commands.sh)"
start=$SECONDS
(cd project && bash -e commands.sh) >page.txt 2>&1 || fail "the page's commands on the right loss:\n$(cat page.txt)"
grep -qE "3 passed, 3 skipped" page.txt || fail "the page's commands:\n$(cat page.txt)"
grep -q "streambp-conform: 3 case(s) judged (3 passed, 0 failed), 3 N/A" page.txt || fail "the summary:\n$(cat page.txt)"
# --streambp-warm: the 6 adapter runs in workers; the bf16 case's hf baseline, another python, cold
grep -q "streambp-conform: 6 adapter run(s) in warm workers" page.txt || fail "warm workers:\n$(cat page.txt)"
python3 - project/conform.xml <<'PY' || fail "conform.xml:\n$(cat project/conform.xml)"
import sys, xml.etree.ElementTree as ET
cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
verdicts = {c.get("name"): "skipped" if c.find("skipped") is not None else "failed" if c.find("failure") is not None
            else "passed" for c in cases}
expected = {f"test_my_loss[{c}]": "passed" for c in ("sft-gqa-qknorm-tied-fp64", "sft-mha-bias-untied-fp64",
                                                     "sft-bf16-bf16")}
expected.update({"test_my_loss[sft-lora-fp64]": "skipped", "test_my_loss[sft-micro3-fp64]": "skipped",
                 "test_my_loss[sft-packed-fp64]": "skipped"})
assert verdicts == expected, verdicts
assert {c.get("classname") for c in cases} == {"streambp.conform.sft"}, [c.attrib for c in cases]
reasons = {c.get("name"): c.find("skipped").get("message") for c in cases if c.find("skipped") is not None}
assert "LoRA: full fine-tuning only" in reasons["test_my_loss[sft-lora-fp64]"], reasons
assert "3 micro-batches: this adapter runs one batch per optimizer step" in reasons["test_my_loss[sft-micro3-fp64]"], reasons
# a sample that never declared packing (run()'s packs=False) does not attend across packed sequences unawares
assert "does not declare packed rows: run(..., packs=True)" in reasons["test_my_loss[sft-packed-fp64]"], reasons
PY
echo "ok: the page's job on the right loss ($((SECONDS - start)) s): $(grep -E "passed|failed" page.txt | tail -1)"

status=0
start=$SECONDS
(cd project && SAMPLE_LOSS=chunk-shift STREAMBP=streambp/ci-build/streambp .venv/bin/pytest tests/conform -k tied -x \
  --junitxml wrong.xml) >wrong.txt 2>&1 || status=$?
[[ $status -eq 1 ]] || fail "the chunk-shift loss: pytest exit $status, expected 1:\n$(cat wrong.txt)"
grep -qE "^=+ 1 failed, 4 deselected in " wrong.txt || fail "-x did not stop at the first case:\n$(cat wrong.txt)"
verdict="worst tensor '(model\.|lm_head)[a-z_.0-9]+': [0-9.e+-]+;.* > the fp64 bar 1e-10"
grep -qE "$verdict" wrong.txt || fail "the tensor is not named in pytest's output:\n$(cat wrong.txt)"
# the harness's hint for a target lost between tiles, in pytest's output and the JUnit file
grep -q "tile boundary" wrong.txt || fail "no 'tile boundary' in the verdict:\n$(cat wrong.txt)"
python3 - project/wrong.xml "$verdict" <<'PY' || fail "wrong.xml:\n$(cat project/wrong.xml)"
import re, sys, xml.etree.ElementTree as ET
(failure,) = ET.parse(sys.argv[1]).getroot().iter("failure")
words = failure.get("message") + (failure.text or "")
assert re.search(sys.argv[2], words) and "tile boundary" in words, words
PY
! grep -qE "pytest_plugin.py|Traceback" wrong.txt || fail "a traceback into the plugin:\n$(cat wrong.txt)"
echo "ok: STREAMBP, -k and -x on the chunk-shift loss ($((SECONDS - start)) s): $(grep -m1 -oE "worst tensor '[^']+': [0-9.e+-]+" wrong.txt)"

status=0
(cd project && .venv/bin/pytest tests/conform --streambp streambp/ci-build/streambp -k lora) >na.txt 2>&1 || status=$?
[[ $status -eq 1 ]] && grep -q "1 skipped" na.txt &&
  grep -q "no case was judged (every one N/A), so the session fails; --streambp-allow-none-judged allows that" na.txt ||
  fail "a session of N/A cases only: exit $status\n$(cat na.txt)"
(cd project && .venv/bin/pytest tests/conform --streambp streambp/ci-build/streambp -k micro3 \
  --streambp-allow-none-judged) >allowed.txt 2>&1 || fail "--streambp-allow-none-judged:\n$(cat allowed.txt)"
echo "ok: a session of N/A cases fails, and passes when allowed"

status=0
(cd project && env -u STREAMBP .venv/bin/pytest tests/conform) >nobinary.txt 2>&1 || status=$?
[[ $status -ne 0 ]] && grep -q "no harness binary: pass --streambp PATH (or set STREAMBP) .*docs/conform-in-ci.md" \
  nobinary.txt && ! grep -q "Traceback" nobinary.txt || fail "a missing binary (exit $status):\n$(cat nobinary.txt)"
echo "ok: a missing binary: $(grep -m1 -o "no harness binary.*" nobinary.txt)"
