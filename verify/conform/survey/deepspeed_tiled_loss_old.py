#!/usr/bin/env python3
"""The pre-#8587 DeepSpeed path (deepspeed 0.19.7, the last release that ships it; its own venv: experiments/survey/implementations.json):
TiledMLP on every decoder MLP (deepspeed_common.py) and the SFT loss through the removed `TiledLoss`, called as its own
docstring and its only caller (UlyssesSPFwdLossBwdWithLogits.compute_loss) do:
    TiledLoss.apply(loss_fn, logits, vocab_size, shift_labels, num_shards)
with loss_fn(logits=, labels=None, vocab_size=, shift_labels=) -> the mean CE of the tile (HF's ForCausalLMLoss
signature). HF's model.loss_function upcasts logits with .float(), which would round an fp64 case to fp32, so loss_fn
here is HF's fixed_cross_entropy on logits raised to at least fp32 (fp64 stays fp64): same signature, same mean.

TiledLoss's `all((shift_labels_shard == -100).squeeze())` only works on [1, T] labels (bs=1, as under ALST/Ulysses),
so the [B, T] batch is passed as one [1, B*T] row (DS_OLD_BATCH=native passes [B, T] as is, to show the crash).
DS_LOSS_TILE: tokens per loss tile (default: case.json's chunks.head). Usage: deepspeed_tiled_loss_old.py CASE_DIR
"""
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import deepspeed_common as ds_common  # noqa: E402
from deepspeed_common import protocol  # noqa: E402

from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledLoss, TiledMLP  # noqa: E402
from transformers.loss.loss_utils import fixed_cross_entropy  # noqa: E402


def sft_loss(model, case):
    ds_common.configure(case)
    if case.objective["name"] != "sft":
        ds_common.not_expressible(f"{case.objective['name']}: TiledLoss is an SFT loss (HF's causal-LM loss per tile)")
    b = case.batch
    lm = ds_common.causal_lm_of(model, case)
    logits = lm(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits  # [B, T, V]
    shift_labels = ds_common.shift(b["labels"])
    if os.environ.get("DS_OLD_BATCH") != "native":
        logits = logits.reshape(1, -1, logits.size(-1))
        shift_labels = shift_labels.reshape(1, -1)
    up = ds_common.loss_dtype(case.dtype)

    def loss_fn(logits, labels, vocab_size, shift_labels):
        return fixed_cross_entropy(logits.to(up).reshape(-1, vocab_size), shift_labels.reshape(-1))

    tile = int(os.environ.get("DS_LOSS_TILE", case.head_chunk))
    shards = max(1, math.ceil(shift_labels.size(1) / tile))
    ds_common.STATS["loss_shards"] = shards
    return TiledLoss.apply(loss_fn, logits, lm.config.vocab_size, shift_labels, shards)


if __name__ == "__main__":
    ds_common.patch_mlps_with_tiled_mlp(TiledMLP)
    rc = protocol.main(sys.argv[1:], sft_loss, "Usage: deepspeed_tiled_loss_old.py CASE_DIR")
    ds_common.report_stats()
    sys.exit(rc)
