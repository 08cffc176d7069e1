#!/usr/bin/env python3
"""DeepSpeed's TiledMLP alone (any release that has it: 0.17.2 before PR #7422, 0.17.3 after) through the conformance
protocol: every decoder MLP through TiledMLP (deepspeed_common.py, as ArcticTraining patches it) and the model's own
causal-LM loss, as ArcticTraining's SFT trainer computes it at one rank (its tiled_mlp option without sequence
parallelism). HF's loss upcasts the logits with .float(), which would round an fp64 case to fp32, so the loss here is
HF's fixed_cross_entropy on logits raised to at least fp32 (fp64 stays fp64): the same mean over the batch's targets.

Why a separate adapter: deepspeed_tiled.py imports TiledFusedLogitsLoss, which 0.17.2 does not have. Before PR #7422
(0.17.3) TiledMLP split x [B, T, H] along T but gave each shard the slice of the *flattened* gradient buffer at
i * shard.numel(), which is that shard's only when B = 1: with B > 1 the rows' gradients are mixed up.
SFT, one process. Usage: deepspeed_tiled_mlp.py CASE_DIR
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import deepspeed_common as ds_common  # noqa: E402
from deepspeed_common import protocol  # noqa: E402

from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP  # noqa: E402
from transformers.loss.loss_utils import fixed_cross_entropy  # noqa: E402


def sft_loss(model, case):
    ds_common.configure(case)
    if case.objective["name"] != "sft":
        ds_common.not_expressible(f"{case.objective['name']}: this adapter runs SFT (the model's causal-LM loss)")
    b = case.batch
    lm = ds_common.causal_lm_of(model, case)
    logits = lm(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits  # [B, T, V]
    targets = ds_common.shift(b["labels"])  # [B, T]
    return fixed_cross_entropy(logits.to(ds_common.loss_dtype(case.dtype)).flatten(0, 1), targets.flatten())


if __name__ == "__main__":
    ds_common.patch_mlps_with_tiled_mlp(TiledMLP)
    rc = protocol.main(sys.argv[1:], sft_loss, "Usage: deepspeed_tiled_mlp.py CASE_DIR")
    ds_common.report_stats()
    sys.exit(rc)
