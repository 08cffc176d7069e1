#!/usr/bin/env python3
"""Liger-Kernel (PyPI liger-kernel) under the conformance protocol streambp-conform/1, SFT, full fine-tuning or LoRA.

Usage: liger_adapter.py [--gradient-checkpointing] [--flce-only | --reduction-none | --ce-reduction-none |
                         --tiled-swiglu | --rope-only] CASE_DIR

default           Liger's documented HF integration: apply_liger_kernel_to_<qwen3|qwen2|llama>(model=...) on the
                  loaded model (its defaults: RoPE, RMSNorm, SwiGLU kernels and the fused linear cross-entropy head),
                  then model(input_ids, attention_mask, labels, skip_logits=True).loss: LigerForCausalLMLoss, i.e.
                  LigerFusedLinearCrossEntropyFunction with reduction="mean" over the shifted labels. (skip_logits is
                  passed because Liger only takes the fused path by itself in train mode, and the protocol loads the
                  model in eval mode unless checkpointing.)
--flce-only       the same with rope=False, rms_norm=False, swiglu=False: only the fused linear CE is Liger's. Takes
                  packed cases (position_ids, no mask) and micro-batches (num_items_in_batch: the step's targets).
--reduction-none  issue #968's setting: the (unpatched HF) decoder's hidden states, LigerFusedLinearCrossEntropyLoss(reduction="none")
                  per token, then (per_token * mask).sum() / mask.sum() by hand (mask = target != -100). Equal to the
                  mean in exact arithmetic; before liger-kernel 0.8.2 (PR #1298) the backward scaled every gradient by
                  grad_output[0], which is 0 when the first position is masked (a prompt or padding): zero gradients
                  for lm_head and everything below it.
--ce-reduction-none  issue #678's setting (a Trainer.compute_loss override): the (unpatched HF) model's logits, upcast
                  with .float(), shifted, LigerCrossEntropyLoss(reduction="none") per token, then the same masked mean
                  by hand. Before liger-kernel 0.5.9 its backward scaled the logits' gradient by grad_output[0] only
                  (a scalar load), so a masked first target zeroes every gradient.
--tiled-swiglu    LigerTiledSwiGLUMLP in every decoder layer, as its docstring offers it for long sequences (a module
                  swapped in by hand: no apply_liger_kernel_to_* option builds it), with its default shard count
                  (ceil(T / hidden_size)) and the layer's own projections (PEFT's LoRA-wrapped ones included); the
                  rest of the model and the loss are HF's. Its backward recomputes each shard's MLP (DeepSpeed's
                  TiledMLP, flattened rows) and its SiLU-times-up is Liger's Triton kernel.
--rope-only       Liger's RoPE kernel alone, on packed cases too: liger_rotary_pos_emb installed as the model module's
                  apply_rotary_pos_emb (what apply_liger_kernel_to_<family>(rope=True) does; 0.5.x has no such
                  function for qwen3), nothing else patched. The inputs are a packed case's position_ids [B, T] and
                  a 4-D block-diagonal causal mask built from its boundaries (packed_rows.py), which is how a
                  transformers before 4.54 (no packing detection from position_ids) takes packed rows on SDPA. The
                  loss is the token cross-entropy sum in the logits' dtype raised to >= fp32 (fp64 kept) over the
                  step's target count, micro-batches accumulated: the bar is the case's, fp64 included. This is the
                  setting of linkedin/Liger-Kernel PR #477 (0.5.3): before it the kernel rotated every row with row
                  0's cos/sin, so it shows on >= 2 packed rows whose boundaries differ.

Runs on CUDA. Without a GPU it exits 2 with "needs a GPU: ...", unless TRITON_INTERPRET=1: then Liger's Triton
kernels run on CPU in Triton's interpreter (gpu_common.py). Gradients are written on CPU in the model dtype.
Liger's CE kernel computes the loss and the logits' gradient in fp32 whatever the model dtype, so fp64 cases are not
expected to meet the fp64 bar (1e-10): it measures ~1e-8.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_common  # noqa: E402
import packed_rows  # noqa: E402
from gpu_common import CaseError, NotExpressible  # noqa: E402

FLAGS = ("--flce-only", "--reduction-none", "--ce-reduction-none", "--tiled-swiglu", "--rope-only")
HAND_LOSSES = ("--reduction-none", "--ce-reduction-none")  # the plain HF model, only the loss is Liger's
USAGE = ("Usage: liger_adapter.py [--gradient-checkpointing] [--flce-only | --reduction-none | --ce-reduction-none | "
         "--tiled-swiglu | --rope-only] CASE_DIR")


def device():
    return gpu_common.pick_device("Liger-Kernel's kernels are Triton programs for CUDA/ROCm/XPU (on CPU Triton "
                                  "raises 'RuntimeError: 0 active drivers ([]). There should only be one.')",
                                  triton_interpretable=True)


def base_of(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT wraps the HF model


def prepare(case, model, flags):
    import logging

    import torch

    logging.getLogger("liger_kernel").setLevel(logging.ERROR)  # backend discovery notes (CuTe DSL, Ascend) on stderr
    import liger_kernel.transformers as lt

    if len([f for f in flags if f in FLAGS]) > 1:
        raise CaseError(f"{' and '.join(FLAGS)} exclude each other")
    if any(f in flags for f in HAND_LOSSES):
        return model  # the plain HF decoder; only the loss is Liger's
    base = base_of(model)
    if "--tiled-swiglu" in flags:
        for layer in base.model.layers:
            tiled = lt.LigerTiledSwiGLUMLP(base.config)
            # the layer's own projections (the same parameters the protocol reads the gradients of)
            tiled.gate_proj, tiled.up_proj, tiled.down_proj = layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj
            layer.mlp = tiled
        return model
    model_type = base.config.model_type
    apply = getattr(lt, f"apply_liger_kernel_to_{model_type}", None)
    if apply is None:
        raise NotExpressible(f"liger-kernel has no apply_liger_kernel_to_{model_type}")
    only_flce = {"rope": False, "rms_norm": False, "swiglu": False} if "--flce-only" in flags else {}
    if case.dtype == torch.float64 and not only_flce:
        # liger_kernel/ops/utils.py torch_to_triton_dtype has fp32/fp16/bf16 only: RMSNorm's backward raises
        # KeyError: torch.float64 (the fused CE alone takes fp64: --flce-only, --reduction-none)
        raise NotExpressible("Liger's RMSNorm kernel has no float64 backward (KeyError: torch.float64); "
                        "--flce-only runs fp64 with only the fused CE from Liger")
    # on the instance: protocol.load_model already built it (and, in fp64, patched HF's RMSNorm classes)
    apply(model=base, fused_linear_cross_entropy=True, cross_entropy=False, **only_flce)
    return model


def load_rope_only(case, flags):
    """--rope-only: the case's model under the pinned transformers (fp64 norms kept fp64), Liger's RoPE function in
    its module; (model, every parameter by HF's name)."""
    import importlib

    import torch
    import trainer_step
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from streambp_conform.hf import fp64_exact

    if len([f for f in flags if f in FLAGS]) > 1:
        raise CaseError(f"{' and '.join(FLAGS)} exclude each other")
    if "--gradient-checkpointing" in flags:
        raise CaseError("--rope-only runs without checkpointing")
    if case.lora:
        raise NotExpressible("--rope-only runs full fine-tuning (the RoPE kernel alone on HF's model)")
    model = trainer_step.load_pinned_model(case)
    if case.dtype == torch.float64:
        fp64_exact(model)
    family = model.config.model_type
    importlib.import_module(f"transformers.models.{family}.modeling_{family}").apply_rotary_pos_emb = \
        liger_rotary_pos_emb
    return model, dict(model.named_parameters())


def rope_only_loss(model, case):
    """--rope-only's loss: the step's token cross-entropy sum over its target count (Case.union on a micro-batch)."""
    import torch
    import torch.nn.functional as F

    b = case.batch
    step = case.union if case.union is not None else b
    if case.packed:
        inputs = {"position_ids": b["position_ids"], "attention_mask": packed_rows.block_mask(case, case.dtype)}
    else:
        inputs = {"attention_mask": b["attention_mask"]}
    logits = model(input_ids=b["input_ids"], **inputs).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    targets = gpu_common.shifted_targets(b["labels"]).flatten()
    total = (gpu_common.shifted_targets(step["labels"]) != -100).sum().clamp(min=1)
    return F.cross_entropy(logits.flatten(0, 1), targets, ignore_index=-100, reduction="sum") / total


def flce_only_loss(model, case):
    """--flce-only's loss: Liger's patched forward and fused linear CE. A packed case gives position_ids and no mask
    (transformers >= 4.54 finds the sequences from them, as the hf baseline takes packed rows); a micro-batch passes
    the step's target count as num_items_in_batch, as transformers' Trainer does, so the fused CE sums and divides by
    it instead of taking the micro-batch's mean."""
    b = case.batch
    inputs = {"position_ids": b["position_ids"]} if case.packed else {"attention_mask": b["attention_mask"]}
    if case.union is not None:
        inputs["num_items_in_batch"] = (gpu_common.shifted_targets(case.union["labels"]) != -100).sum()
    return model(input_ids=b["input_ids"], labels=b["labels"], skip_logits=True, **inputs).loss


def loss(model, case, flags):
    import torch

    b = case.batch
    if "--rope-only" in flags:
        return rope_only_loss(model, case)
    if "--tiled-swiglu" in flags:
        return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss
    if "--flce-only" in flags:
        return flce_only_loss(model, case)
    if not any(f in flags for f in HAND_LOSSES):
        return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"],
                     skip_logits=True).loss
    base = base_of(model)
    targets = gpu_common.shifted_targets(b["labels"]).flatten()
    if "--ce-reduction-none" in flags:
        from liger_kernel.transformers import LigerCrossEntropyLoss

        logits = base(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float()  # [B, T, V]
        per_token = LigerCrossEntropyLoss(reduction="none", ignore_index=-100)(logits.flatten(0, 1), targets)
    else:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        hidden = base.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
        per_token = LigerFusedLinearCrossEntropyLoss(reduction="none", ignore_index=-100)(
            base.lm_head.weight, hidden.flatten(0, 1), targets)  # hidden: [B*T, H]
    mask = (targets != -100).to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def load(case, flags):
    if "--rope-only" in flags:
        return load_rope_only(case, flags)
    model, trainable = gpu_common.protocol.load_model(case, gradient_checkpointing="--gradient-checkpointing" in flags)
    return prepare(case, model, flags) or model, trainable


def declares(flags):
    """--rope-only and --flce-only normalise micro-batches by the step's totals and take packed rows; the other
    settings neither."""
    return {"accumulates": True, "packs": True} if "--rope-only" in flags or "--flce-only" in flags else {}


if __name__ == "__main__":
    sys.exit(gpu_common.main(sys.argv[1:], USAGE, FLAGS, device, prepare, loss, load=load, declares=declares))
