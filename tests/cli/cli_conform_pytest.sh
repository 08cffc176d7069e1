#!/bin/bash
# The user's side of `streambp conform` in CI (issue #47, docs/conform-in-ci.md), with the page's own commands: a
# fresh venv with another torch than the harness's (2.13.0 CPU; cached in ~/.cache/streambp, as the survey's venvs),
# `pip install ./verify/conform`, and pytest on the sample project tests/conform_sample against the built harness:
#   - the right chunked loss passes its fp64 SFT cases of the ci set (LoRA and the micro-batch step skipped, with
#     their reasons), and --junitxml holds them;
#   - the chunk-means loss fails, `-x` stopping at the first case, the tensor named in pytest's output and the JUnit
#     file, without a traceback into the plugin;
#   - a missing binary is one error naming --streambp and the docs page.
# Usage: cli_conform_pytest.sh BINARY PYTHON
# ctest-needs-python
# ctest-timeout: 900
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
# The docs' commands from here on (docs/conform-in-ci.md): install the package, run pytest with --junitxml.
cp -r "$SRC/verify/conform" package  # pip builds in the source folder: a copy keeps the checkout clean
"$PY" -m pip install --quiet --no-build-isolation --no-deps ./package >pip.log 2>&1 ||
  fail "pip install ./verify/conform:\n$(cat pip.log)"
[[ $("$PY" -c "import torch; print(torch.__version__)") == 2.13.0* ]] || fail "the venv's torch is not 2.13.0"
pytest=("$PY" -m pytest -p no:cacheprovider --rootdir "$SRC/tests/conform_sample" "$SRC/tests/conform_sample" -rs)

"${pytest[@]}" --streambp "$STREAMBP" -k "not wrong" --junitxml right.xml >right.txt 2>&1 ||
  fail "the right loss does not pass:\n$(cat right.txt)"
grep -qE "2 passed, 2 skipped" right.txt || fail "the right loss:\n$(cat right.txt)"
grep -qE "SKIPPED .*sft-lora.*LoRA: this project trains full weights only" right.txt &&
  grep -qE "SKIPPED .*sft-micro3.*3 micro-batches: this adapter runs one batch per optimizer step" right.txt ||
  fail "the skipped cases lack their reasons:\n$(cat right.txt)"
python3 - right.xml <<'PY' || fail "right.xml:\n$(cat right.xml)"
import sys, xml.etree.ElementTree as ET
suite = ET.parse(sys.argv[1]).getroot().find("testsuite")
names = sorted(c.get("name") for c in suite.iter("testcase"))
assert names == ["test_chunked_loss[sft-gqa-qknorm-tied-fp64]", "test_chunked_loss[sft-lora-fp64]",
                 "test_chunked_loss[sft-mha-bias-untied-fp64]", "test_chunked_loss[sft-micro3-fp64]"], names
assert suite.get("failures") == "0" and suite.get("skipped") == "2", suite.attrib
PY
echo "ok: the right chunked loss passes: $(tail -1 right.txt)"

status=0
STREAMBP=$STREAMBP "${pytest[@]}" -k wrong -x --junitxml wrong.xml >wrong.txt 2>&1 || status=$?
[[ $status -eq 1 ]] || fail "the wrong loss: pytest exit $status, expected 1:\n$(cat wrong.txt)"
grep -qE "1 failed" wrong.txt && ! grep -q "passed" wrong.txt || fail "-x did not stop at the first case:\n$(cat wrong.txt)"
grep -qE "worst tensor 'model\.[a-z_.0-9]+': [0-9.e+-]+;.* > the fp64 bar 1e-10" wrong.txt ||
  fail "the tensor is not named in pytest's output:\n$(cat wrong.txt)"
! grep -qE "pytest_plugin.py|Traceback" wrong.txt || fail "a traceback into the plugin:\n$(cat wrong.txt)"
python3 - wrong.xml <<'PY' || fail "wrong.xml:\n$(cat wrong.xml)"
import sys, xml.etree.ElementTree as ET
(failure,) = ET.parse(sys.argv[1]).getroot().iter("failure")
assert "worst tensor 'model." in failure.get("message", "") + (failure.text or ""), failure.attrib
PY
echo "ok: the chunk-means loss fails: $(grep -m1 -oE "worst tensor '[^']+': [0-9.e+-]+" wrong.txt)"

status=0
env -u STREAMBP "${pytest[@]}" >nobinary.txt 2>&1 || status=$?
[[ $status -ne 0 ]] && grep -q "no harness binary: pass --streambp PATH (or set STREAMBP) .*docs/conform-in-ci.md" \
  nobinary.txt && ! grep -q "Traceback" nobinary.txt || fail "a missing binary (exit $status):\n$(cat nobinary.txt)"
echo "ok: a missing binary: $(grep -m1 -o "no harness binary.*" nobinary.txt)"
