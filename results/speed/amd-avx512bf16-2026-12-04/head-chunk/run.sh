#!/bin/bash
cd /work/main
export STREAMBP_GEMM_PROBE=off
for r in 1 2; do for hc in 1024 256 128; do
  /usr/bin/time -v build/streambp run --preset qwen3-small --dtype fp32 --seq 8192 --method streambp:layer_chunk=512,head_chunk=$hc --threads 2 --seed 1 > /tmp/hc/r$r-$hc.log 2>&1
done; done
echo done > /tmp/hc/finished
