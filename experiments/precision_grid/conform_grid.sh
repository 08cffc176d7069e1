#!/usr/bin/env bash
# The low-precision rule's statistic for the shipped HF adapters through `streambp conform` (issue #28): HF
# Transformers' gradient checkpointing (`--impl hf-checkpointing`, PEFT under LoRA) judged against HF's standard BP in
# the same dtype (`--baseline hf`), both exact, over SEEDS seeds x SFT/GRPO/DPO x full/LoRA x fp32/bf16 on tiny
# (B = 3, T = 37, ragged). conform's CSV records each case's worst statistic (its `worst` column: 1 = at the allowance).
#   experiments/precision_grid/conform_grid.sh STREAMBP_BINARY OUT_DIR [SEEDS=20]
# Writes OUT_DIR/conform-hf-checkpointing/ (conform's results folder) and the cases file beside it; summarize.py reads it.
set -euo pipefail
streambp=$1 out=$2 seeds=${3:-20}
dir="$out/conform-hf-checkpointing"
[[ -e $dir ]] && { echo "error: $dir exists; results are never overwritten" >&2; exit 2; }
mkdir -p "$out"
cases="$out/conform-cases.json"
python3 - "$seeds" >"$cases" <<'EOF'
import json, sys
cases = []
for seed in range(int(sys.argv[1])):
    for objective, group in (("sft", 0), ("grpo:beta=0.04,loss_type=grpo", 3), ("dpo:beta=0.1", 0)):
        for lora in ("", "rank=4,alpha=8,init=random"):
            for dtype in ("fp32", "bf16"):
                name = f"{objective.split(':')[0]}-{'lora' if lora else 'full'}-{dtype}-seed{seed}"
                # DPO pairs rows: an even batch.
                cases.append({"name": name, "objective": objective, "lora": lora, "dtype": dtype,
                              "batch": 4 if objective.startswith("dpo") else 3, "seq": 37, "group": group,
                              "seed": 1000 + seed})
json.dump(cases, sys.stdout, indent=1)
EOF
"$streambp" conform --impl hf-checkpointing --baseline hf --cases "$cases" --out "$dir"
