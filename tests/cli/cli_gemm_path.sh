#!/usr/bin/env bash
# The bf16 GEMM paths' choice from the command line (core/model/gemm_store.h, issue #49), timing nothing: under
# STREAMBP_NARROW_GEMM=stored (the tests' setting) a process with an empty cache folder takes the flag rule and
# writes nothing there, `gemm-path` shows that choice without measuring, `run` prints the choice and where it came
# from, STREAMBP_NARROW_GEMM=native|widened pins it, and a bad value is a usage error naming the variable.
source "$(dirname "$0")/../support/cli_common.sh"

mkdir cache
export STREAMBP_CACHE=$WORK/cache
tiny=(run --preset tiny --method streambp --seq 16 --dtype bf16 --threads 1)

STREAMBP_NARROW_GEMM=stored "$STREAMBP" gemm-path >show.log 2>&1 || fail "gemm-path:\n$(cat show.log)"
grep -q "^machine   .*, bf16, " show.log || fail "gemm-path names no key:\n$(cat show.log)"
grep -qE "^bf16      nt=(native|widened),nn=(native|widened),tn=(native|widened) \(.*(none stored in $WORK/cache|nothing to measure)" show.log ||
  fail "gemm-path on an empty cache:\n$(cat show.log)"
echo "ok: $(grep '^bf16 ' show.log)"

STREAMBP_NARROW_GEMM=stored "$STREAMBP" "${tiny[@]}" >stored.log 2>&1 || fail "run:\n$(cat stored.log)"
grep -qE "^kernels   bf16 GEMMs nt=[a-z]+,nn=[a-z]+,tn=[a-z]+ \(.+\)" stored.log ||
  fail "run prints no choice:\n$(cat stored.log)"
[[ -z $(ls cache) ]] || fail "a process under STREAMBP_NARROW_GEMM=stored wrote to the cache: $(ls cache)"
echo "ok: $(grep '^kernels   bf16' stored.log)"

for path in native widened; do
  STREAMBP_NARROW_GEMM=$path "$STREAMBP" "${tiny[@]}" >$path.log 2>&1 || fail "run pinned $path:\n$(cat $path.log)"
  grep -q "^kernels   bf16 GEMMs nt=$path,nn=$path,tn=$path (pinned by STREAMBP_NARROW_GEMM=$path)" $path.log ||
    fail "STREAMBP_NARROW_GEMM=$path:\n$(cat $path.log)"
done
echo "ok: pinned native and widened"
STREAMBP_NARROW_GEMM=fast expect_exit_2 "STREAMBP_NARROW_GEMM=fast" \
  "STREAMBP_NARROW_GEMM: GEMM path 'fast' \\(expected native or widened, or stored\\)" "$STREAMBP" "${tiny[@]}"
