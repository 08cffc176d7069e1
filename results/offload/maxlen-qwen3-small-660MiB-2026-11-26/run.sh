#!/usr/bin/env bash
# The longest training sequence under a 660 MiB device budget (qwen3-small, fp32, AdamW, one sequence), measured:
# every checkpointing method without offload and with everything offloaded (checkpoints, gradients, optimizer
# states, parameters). From this folder: STREAMBP=<build>/streambp bash run.sh
set -euo pipefail
cd "$(dirname "$0")"
STREAMBP=${STREAMBP:-../../../build/streambp}
common=(maxlen --preset qwen3-small --budget-bytes 692060160 --optimizer adamw:lr=1e-5 --threads 2
        --methods "checkpoint;mst:mini_seq=64;streambp:layer_chunk=64,head_chunk=64" --out .)
"$STREAMBP" "${common[@]}" 2>&1 | tee none.log
"$STREAMBP" "${common[@]}" --offload checkpoints,grads,optimizer,params --offload-dir . 2>&1 | tee all.log
lscpu | grep -E "^(Model name|Flags)" > lscpu.txt
