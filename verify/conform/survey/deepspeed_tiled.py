#!/usr/bin/env python3
"""DeepSpeed ALST (deepspeed 0.19.8) through the StreamBP conformance protocol: HF model (protocol.load_model), every
decoder MLP through deepspeed's TiledMLP (deepspeed_common.py), the loss through deepspeed's TiledFusedLogitsLoss on the
final hidden states (the full logits tensor is never built). Usage: deepspeed_tiled.py CASE_DIR

SFT. --loss=MODE (or the environment's DS_LOSS) selects how TiledFusedLogitsLoss is called (all are calls of the same
library function):
  global (default)  fn(self, x, y) = sum of the tile's token CEs / N (N = the batch's target count, known up front),
                    output_reduction="sum": the loss and both gradients (x and lm_head) are exact.
  arctic            ArcticTraining's SFT trainer (arctic_training/trainer/sft_trainer.py): fn returns the tile's mean
                    CE * its target count (0 * logits.sum() for an all -100 tile), output_reduction="sum", and the
                    *output* is divided by N afterwards (the docstring's "use sum and perform the balanced mean to
                    the output").
  doc               the TiledFusedLogitsLoss docstring example: fn returns the tile's mean CE, output_reduction="mean"
                    (a mean of tile means; nan as soon as one tile has no target).
  docguard          doc with ArcticTraining's all -100 guard (such a tile returns 0 * logits.sum()): finite, still a
                    mean of tile means.
  tutorial          not TiledFusedLogitsLoss but the generic sequence_tiled_compute (SequenceTiledCompute), as the
                    DeepSpeed ALST tutorial's "Tiled loss computation" shows it: tiles on the sequence dimension,
                    fn returns the tile's CE sum (mean * count), output_unshard_dimension=0, output_reduction="sum",
                    the output divided by N afterwards. SequenceTiledCompute recomputes each tile in its backward
                    with the upstream gradient, so the division reaches every gradient.
GRPO, token-level importance (loss_type grpo, bnpo, dapo, dr_grpo; with or without the KL term): every token's term
  depends on that token's log-prob only, so the loss is sum_t w_t * term_t with w_t the loss type's normaliser
  (1/(B*n_row), 1/N or 1/(B*max_completion_length)) known before the forward. fn gets the per-token side data through
  TiledFusedLogitsLoss's y ([B, T, 4]: next token id, old log-prob, reference log-prob, advantage) and w as its mask
  argument; output_reduction="sum". Formulas: verify/conform/losses.py (TRL's).
Not expressible (exit 3): GRPO with sequence-level importance (exp of the row's mean log-ratio couples every tile of
  the row) and DPO (a nonlinear function of row sums of log-probs): TiledFusedLogitsLoss reduces tile outputs by a
  plain sum/mean, so a loss that is not a sum of per-tile terms needs a first pass for the row statistics and a
  surrogate, which is code of one's own around it, not the library's pattern.
DS_LOSS_TILE: tokens per loss tile (default: case.json's chunks.head); the tiles run over the flattened B*T tokens.
"""
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import deepspeed_common as ds_common  # noqa: E402
from deepspeed_common import protocol  # noqa: E402
import losses  # noqa: E402  (verify/conform/losses.py, on sys.path through ds_common)

from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP  # noqa: E402
from deepspeed.runtime.sequence_parallel.ulysses_sp import sequence_tiled_compute  # noqa: E402
from transformers.loss.loss_utils import fixed_cross_entropy  # noqa: E402

MODE = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--loss=")), os.environ.get("DS_LOSS", "global"))


def loss_shards(case, n_tokens):
    tile = int(os.environ.get("DS_LOSS_TILE", case.head_chunk))
    shards = max(1, math.ceil(n_tokens / tile))
    ds_common.STATS["loss_shards"] = shards
    return shards


def sft_loss(model, case):
    b = case.batch
    if "labels" not in b:
        raise protocol.CaseError("sft: batch.safetensors has no 'labels'")
    lm = ds_common.causal_lm_of(model, case)
    hidden = lm.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state  # [B, T, H]
    shift_labels = ds_common.shift(b["labels"])
    n_targets = (shift_labels != -100).sum()
    if n_targets == 0:
        raise protocol.CaseError("sft: no target token in the batch")
    shards = loss_shards(case, shift_labels.numel())
    vocab = lm.config.vocab_size
    up = ds_common.loss_dtype(case.dtype)
    compute_params = [lm.lm_head.weight]

    if MODE == "global":
        def fn(self, x, y):  # x [n, H], y [n]: one tile of the flattened tokens
            logits = self.lm_head(x).to(up)
            return fixed_cross_entropy(logits.view(-1, vocab), y.view(-1), num_items_in_batch=n_targets)

        return TiledFusedLogitsLoss.apply(fn, lm, hidden, shift_labels, None, shards, compute_params, "sum")
    if MODE == "arctic":
        def fn(self, x, y):
            logits = self.lm_head(x).to(up)
            if bool((y == -100).all()):  # ArcticTraining's guard: CE of an all -100 tile is nan
                return logits.sum() * 0.0
            good = (y != -100).sum()
            return fixed_cross_entropy(logits.view(-1, vocab), y.view(-1)) * good  # tile mean * tile count

        total = TiledFusedLogitsLoss.apply(fn, lm, hidden, shift_labels, None, shards, compute_params, "sum")
        return total / max(n_targets, 1)
    if MODE in ("doc", "docguard"):
        def fn(self, x, y):
            logits = self.lm_head(x).to(up)
            if MODE == "docguard" and bool((y == -100).all()):
                return logits.sum() * 0.0
            return fixed_cross_entropy(logits.view(-1, vocab), y.view(-1))  # the tile's own mean

        return TiledFusedLogitsLoss.apply(fn, lm, hidden, shift_labels, None, shards, compute_params, "mean")
    if MODE == "tutorial":
        def loss_fn(hidden_states, shift_labels, model, vocab_size):  # one tile: [B, t, H], [B, t]
            logits = model.lm_head(hidden_states).to(up)
            good = (shift_labels != -100).sum()
            if good == 0:
                return logits.sum() * 0.0
            return fixed_cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1)) * good

        T = shift_labels.size(1)
        seq_shards = max(1, math.ceil(T / int(os.environ.get("DS_LOSS_TILE", case.head_chunk))))
        ds_common.STATS["loss_shards"] = seq_shards
        total = sequence_tiled_compute(loss_fn, T, seq_shards, dict(hidden_states=hidden, shift_labels=shift_labels),
                                       dict(model=lm, vocab_size=vocab), "hidden_states", compute_params,
                                       output_unshard_dimension=0, output_reduction="sum")
        return total / max(n_targets, 1)
    raise protocol.CaseError(f"--loss={MODE!r} (global, arctic, doc, docguard or tutorial)")


def grpo_loss(model, case):
    o = losses.grpo_options(case.objective)
    if o["level"] != "token":
        ds_common.not_expressible("GRPO importance_sampling_level=sequence: the row's mean log-ratio couples its "
                                  "tiles; TiledFusedLogitsLoss only sums or averages per-tile outputs")
    b = case.batch
    for key in ("completion_mask", "advantages"):
        if key not in b:
            raise protocol.CaseError(f"grpo: batch.safetensors has no {key!r}")
    ref = losses.reference(model, case, "grpo") if o["beta"] != 0.0 else None  # no_grad, before the graph
    lm = ds_common.causal_lm_of(model, case)
    hidden = lm.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state  # [B, T, H]
    up = ds_common.loss_dtype(case.dtype)
    ids = b["input_ids"]
    B, T = ids.shape
    mask = b["completion_mask"][:, 1:].to(up)  # [B, T-1]: position t scores token t+1
    if o["loss_type"] == "grpo":
        w = mask / mask.sum(-1, keepdim=True).clamp(min=1.0) / B
    elif o["loss_type"] in ("bnpo", "dapo"):
        w = mask / mask.sum().clamp(min=1.0)
    else:  # dr_grpo
        w = mask / (B * o["max_len"])
    pad = lambda t: F.pad(t, (0, 1))  # noqa: E731  position T-1 predicts nothing (weight 0)
    has_old = "old_logps" in b
    y = torch.stack([pad(ids[:, 1:].to(up)),
                     pad(b["old_logps"][:, 1:].to(up)) if has_old else torch.zeros(B, T, dtype=up),
                     pad(ref[:, 1:].to(up)) if ref is not None else torch.zeros(B, T, dtype=up),
                     b["advantages"].to(up).unsqueeze(1).expand(B, T)], dim=-1)  # [B, T, 4]
    w = pad(w)
    temp, lo, hi, beta = o["temperature"], 1 - o["eps_low"], 1 + o["eps_high"], o["beta"]

    def fn(self, x, y, w):  # x [n, H], y [n, 4], w [n]
        logp = torch.log_softmax(self.lm_head(x).to(up) / temp, dim=-1)
        logp = logp.gather(-1, y[:, 0].long().unsqueeze(-1)).squeeze(-1)
        old = y[:, 1] if has_old else logp.detach()
        coef_1 = torch.exp(logp - old)
        coef_2 = torch.clamp(coef_1, lo, hi)
        adv = y[:, 3]
        per = -torch.min(coef_1 * adv, coef_2 * adv)
        if beta != 0.0:
            d = y[:, 2] - logp
            per = per + beta * (torch.exp(d) - d - 1)
        return (per * w).sum()

    shards = loss_shards(case, B * T)
    return TiledFusedLogitsLoss.apply(fn, lm, hidden, y, w, shards, [lm.lm_head.weight], "sum")


def loss(model, case):
    ds_common.configure(case)
    name = case.objective["name"]
    if name == "sft":
        return sft_loss(model, case)
    if name == "grpo":
        return grpo_loss(model, case)
    ds_common.not_expressible(f"{name}: DPO's loss is a nonlinear function of row sums of log-probs, not a sum of "
                              "per-tile terms (TiledFusedLogitsLoss's only reductions are sum and mean)")


if __name__ == "__main__":
    ds_common.patch_mlps_with_tiled_mlp(TiledMLP)
    rc = protocol.main([a for a in sys.argv[1:] if not a.startswith("--loss=")], loss,
                       "Usage: deepspeed_tiled.py [--loss=global|arctic|doc|docguard|tutorial] CASE_DIR")
    ds_common.report_stats()
    sys.exit(rc)
