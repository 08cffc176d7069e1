#!/bin/bash
# The user's side of `streambp conform` in CI (issue #47, docs/conform-in-ci.md), with the page's own commands: a
# fresh venv with another torch than the harness's (2.13.0 CPU; cached in ~/.cache/streambp, as the survey's venvs),
# the page's GitHub job commands (pip install ./verify/conform, pytest --junitxml) on the sample project
# tests/conform_sample against the built harness:
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
[[ $("$PY" -c "import torch; print(torch.__version__)") == 2.13.0* ]] || fail "the venv's torch is not 2.13.0"

# A user's project as the page's jobs see it after the harness build: the harness checked out in streambp/ (here its
# package and built binary), the sample as tests/conform, the venv, a requirements.txt.
mkdir -p project/streambp/ci-build project/streambp/verify project/tests
cp -r "$SRC/verify/conform" project/streambp/verify/  # pip builds in the source folder: the checkout stays clean
ln -s "$STREAMBP" project/streambp/ci-build/streambp
cp -r "$SRC/tests/conform_sample" project/tests/conform
ln -s "$VENV" project/.venv
printf 'torch==2.13.0\ntransformers==5.18.0\n' >project/requirements.txt
# The GitHub job's commands after its venv is made, as docs/conform-in-ci.md has them: the page cannot rot.
page=$SRC/docs/conform-in-ci.md
sed -n '/^### GitHub Actions/,/^### GitLab/p' "$page" | grep -E '^ +(- run: )?\.venv/bin/' |
  sed -E 's/^ +(- run: )?//' >project/commands.sh
[[ $(grep -c "pip install" project/commands.sh) -eq 1 && $(grep -c "pytest" project/commands.sh) -eq 2 ]] ||
  fail "$page: no '.venv/bin/pip install' and '.venv/bin/pytest' lines in the GitHub job:\n$(cat project/commands.sh)"
status=0
(cd project && bash -e commands.sh) >page.txt 2>&1 || status=$?
# The sample holds the right loss and the wrong one: the job fails, as a project with the wrong one would.
[[ $status -eq 1 ]] || fail "the page's commands: exit $status, expected 1 (the wrong loss):\n$(cat page.txt)"
grep -qE "2 failed, 2 passed, 4 skipped" page.txt || fail "the page's commands:\n$(cat page.txt)"
# --streambp-warm: the 4 judged cases ran in workers (the skipped ones too: the adapter declines them in a worker)
grep -q "streambp-conform: 8 adapter run(s) in warm workers" page.txt || fail "warm workers:\n$(cat page.txt)"
python3 - project/conform.xml <<'PY' || fail "conform.xml:\n$(cat project/conform.xml)"
import sys, xml.etree.ElementTree as ET
suite = ET.parse(sys.argv[1]).getroot().find("testsuite")
verdicts = {c.get("name"): "failed" if c.find("failure") is not None else "skipped" if c.find("skipped") is not None
            else "passed" for c in suite.iter("testcase")}
expected = {"test_chunked_loss[sft-gqa-qknorm-tied-fp64]": "passed", "test_chunked_loss[sft-mha-bias-untied-fp64]": "passed",
            "test_chunked_loss_wrong[sft-gqa-qknorm-tied-fp64]": "failed",
            "test_chunked_loss_wrong[sft-mha-bias-untied-fp64]": "failed"}
expected.update({f"{t}[{c}-fp64]": "skipped" for t in ("test_chunked_loss", "test_chunked_loss_wrong")
                 for c in ("sft-lora", "sft-micro3")})
assert verdicts == expected, verdicts
reasons = {c.get("name"): c.find("skipped").get("message") for c in suite.iter("testcase") if c.find("skipped") is not None}
assert "LoRA: this project trains full weights only" in reasons["test_chunked_loss[sft-lora-fp64]"], reasons
assert "3 micro-batches: this adapter runs one batch per optimizer step" in reasons["test_chunked_loss[sft-micro3-fp64]"], reasons
for failure in suite.iter("failure"):
    assert "worst tensor 'model." in failure.get("message", "") + (failure.text or ""), failure.attrib
PY
echo "ok: the right chunked loss passes, the chunk-means one fails naming the tensor: $(tail -1 page.txt)"

status=0
(cd project && STREAMBP=streambp/ci-build/streambp .venv/bin/pytest tests/conform -k wrong -x) >wrong.txt 2>&1 || status=$?
[[ $status -eq 1 ]] || fail "the wrong loss: pytest exit $status, expected 1:\n$(cat wrong.txt)"
grep -qE "1 failed" wrong.txt && ! grep -q "passed" wrong.txt || fail "-x did not stop at the first case:\n$(cat wrong.txt)"
grep -qE "worst tensor 'model\.[a-z_.0-9]+': [0-9.e+-]+;.* > the fp64 bar 1e-10" wrong.txt ||
  fail "the tensor is not named in pytest's output:\n$(cat wrong.txt)"
! grep -qE "pytest_plugin.py|Traceback" wrong.txt || fail "a traceback into the plugin:\n$(cat wrong.txt)"
echo "ok: STREAMBP, -k and -x: $(grep -m1 -oE "worst tensor '[^']+': [0-9.e+-]+" wrong.txt)"

status=0
(cd project && env -u STREAMBP .venv/bin/pytest tests/conform) >nobinary.txt 2>&1 || status=$?
[[ $status -ne 0 ]] && grep -q "no harness binary: pass --streambp PATH (or set STREAMBP) .*docs/conform-in-ci.md" \
  nobinary.txt && ! grep -q "Traceback" nobinary.txt || fail "a missing binary (exit $status):\n$(cat nobinary.txt)"
echo "ok: a missing binary: $(grep -m1 -o "no harness binary.*" nobinary.txt)"
