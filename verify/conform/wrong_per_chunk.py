#!/usr/bin/env python3
"""The conformance suite's negative control: a plausible-but-wrong chunked implementation that `streambp conform`
must reject. Same HF model, names and protocol as hf_adapter.py; only the loss is wrong, in the ways naive chunking
gets it wrong (the paper's public code has normaliser bugs of its own, judged in the survey: results/survey/):
- SFT: the loss of each sequence chunk of case.json's chunks.head positions is normalised by that chunk's *own*
  target count and the chunk losses are averaged (a mean of chunk means) instead of one division by the batch's
  target count. Exact only when every chunk has the same number of targets.
- GRPO (every loss_type): the same bug, each chunk's loss computed as if the chunk were the whole batch (grpo: the
  chunk's per-row token means; bnpo/dapo: the chunk's token count; dr_grpo: a chunk loss), chunk losses averaged.
- DPO: the first completion token of each row is never scored (the paper's public code's off-by-one), while the
  stored reference sums include it.

Usage: wrong_per_chunk.py CASE_DIR
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from streambp_conform.warm import delegate  # noqa: E402

delegate()  # in a warm worker when STREAMBP_CONFORM_WARM names a server (streambp_conform/warm.py)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import losses  # noqa: E402
import protocol  # noqa: E402


def mean_of_chunk_losses(case, chunk_loss, mask):
    """mask [B, n] of scored positions; chunk_loss(lo, hi) the loss of positions [lo, hi) as if alone."""
    n, c = mask.size(1), case.head_chunk
    parts = [chunk_loss(lo, min(lo + c, n)) for lo in range(0, n, c) if mask[:, lo:lo + c].any()]
    return torch.stack(parts).mean()


def sft_loss(model, case):
    b = case.batch
    logits = losses.forward_logits(model, b)  # [B, T, V]
    shift_labels = F.pad(b["labels"], (0, 1), value=-100)[:, 1:]  # [B, T]

    def chunk(lo, hi):  # cross_entropy's "mean" divides by the chunk's own target count: the bug
        return F.cross_entropy(logits[:, lo:hi].flatten(0, 1), shift_labels[:, lo:hi].flatten(), ignore_index=-100)

    return mean_of_chunk_losses(case, chunk, shift_labels != -100)


def grpo_loss(model, case):
    per_token, mask, o = losses.grpo_per_token(model, case)  # [B, T-1] each ([B, 1] under sequence importance)
    per_token = per_token.expand_as(mask)

    def chunk(lo, hi):
        l, m = per_token[:, lo:hi], mask[:, lo:hi]
        if o["loss_type"] == "grpo":
            return ((l * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
        if o["loss_type"] in ("bnpo", "dapo"):
            return (l * m).sum() / m.sum().clamp(min=1.0)
        return (l * m).sum() / (l.size(0) * o["max_len"])

    return mean_of_chunk_losses(case, chunk, mask)


def dpo_loss(model, case):
    beta, ls = losses.dpo_options(case.objective)
    ref = losses.reference(model, case, "dpo")
    return losses.dpo_from_sums(losses.dpo_row_sums(model, case, skip_first=True), ref, beta, ls)


WRONG = {"sft": sft_loss, "grpo": grpo_loss, "dpo": dpo_loss}


def loss(model, case):
    return WRONG[case.objective["name"]](model, case)


if __name__ == "__main__":
    sys.exit(protocol.main(sys.argv[1:], loss, "Usage: wrong_per_chunk.py CASE_DIR"))
