#!/usr/bin/env python3
"""HF transformers' own Trainer (any release that has Trainer + TrainingArguments) under streambp-conform/1: SFT, full
fine-tuning, micro-batch cases (a one-batch case is a step of one micro-batch).

Usage: hf_trainer.py [--liger] [--flatten] CASE_DIR

The step runs as a Trainer user's does: Trainer(model, TrainingArguments(gradient_accumulation_steps=K, max_steps=1,
max_grad_norm=0), train_dataset=the case's rows).train(), so the Trainer's accumulation loop and its loss
normalisation (before 4.46: each micro-batch's mean divided by K; from 4.46: num_items_in_batch, the step's target
count) are the ones judged. The adapter's two parts, neither a normalisation, are trainer_step.py's: a loader of the
case's micro-batches and a no-op optimizer that keeps the gradient it is handed.
--liger: apply_liger_kernel_to_<family>(model=..., rope/rms_norm/swiglu off) first: Liger's HF integration, its
patched forward and fused linear cross-entropy (where its loss normalisation lives), its other kernels off; Triton's
CPU interpreter when TRITON_INTERPRET=1 (gpu_common.py).
--flatten: padding-free packed rows (issue #59), a packed case only: the case's sequences, cut out of each packed row
by its boundaries (Case.cu_seqlens; a ragged row's padding left out), are the Trainer's features ({"input_ids",
"labels"}), and transformers' own DataCollatorWithFlattening (return_position_ids) makes each micro-batch's sequences
one row with position_ids restarting per sequence, each sequence's first label -100 and no attention_mask, from which
SDPA gets the block-diagonal mask (transformers >= 4.54). One Trainer batch per micro-batch of the case: the
sequences of its rows.
The loss reported is the Trainer's training_loss (its accumulated tr_loss over the one step).
HF's causal-LM loss casts the logits to fp32 (`logits.float()`), so the survey runs this on fp32 cases only.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import protocol  # noqa: E402
import packed_rows  # noqa: E402
import trainer_step  # noqa: E402
from protocol import CaseError, NotExpressible  # noqa: E402

USAGE = "Usage: hf_trainer.py [--liger] [--flatten] CASE_DIR"


def load(case):
    import torch

    if case.dtype == torch.float64:
        raise NotExpressible("fp64: HF's causal-LM loss rounds the logits to fp32 (logits.float())")
    return trainer_step.load_pinned_model(case)


def apply_liger(model):
    import gpu_common

    if gpu_common.pick_device("liger-kernel", triton_interpretable=True) != "cpu":
        raise CaseError("this entry runs on the CPU (the Trainer's use_cpu): set TRITON_INTERPRET=1, hide the GPU")
    import liger_kernel.transformers as lt

    apply = getattr(lt, f"apply_liger_kernel_to_{model.config.model_type}", None)
    if apply is None:
        raise NotExpressible(f"liger-kernel has no apply_liger_kernel_to_{model.config.model_type}")
    # the patched forward and its fused linear cross-entropy only: 0.4.0's RMSNorm backward asks torch.cuda for the
    # SM count, so its other kernels cannot run in the CPU interpreter (off at both pins alike)
    apply(model=model, rope=False, rms_norm=False, swiglu=False, fused_linear_cross_entropy=True)


def run(case, liger, flatten):
    import torch
    import transformers

    if case.objective["name"] != "sft" or case.lora or case.ranks != 1:
        raise NotExpressible("this entry runs the Trainer's SFT step, full fine-tuning, one process")
    if flatten and not case.packed:
        raise NotExpressible("--flatten runs packed cases only (DataCollatorWithFlattening's padding-free rows)")
    model = load(case)
    if liger:
        apply_liger(model)
    if flatten:
        rows, micro = packed_rows.sequences(case)  # each row's sequences, its padding left out
        collate = transformers.DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
    else:
        rows = [{k: v[r] for k, v in case.batch.items() if k in ("input_ids", "attention_mask", "labels")}
                for r in range(case.batch["input_ids"].size(0))]
        micro = case.micro_batches or [list(range(len(rows)))]
        collate = lambda b: {k: torch.stack([r[k] for r in b]) for k in b[0]}  # noqa: E731
    loss, grads, seconds = trainer_step.trainer_step(
        transformers.Trainer,
        lambda out: transformers.TrainingArguments(**trainer_step.step_arguments(out, len(micro)),
                                                   remove_unused_columns=False),
        model, dict(model.named_parameters()), micro, loader_rows=rows, collate=collate, train_dataset=rows)
    return loss, {n: g.to(case.dtype).contiguous() for n, g in grads.items()}, seconds


def main(argv):
    liger, flatten = "--liger" in argv, "--flatten" in argv
    # packs: only --flatten keeps packed sequences apart; the stacked rows would attend across them
    return protocol.run(lambda case: run(case, liger, flatten), [a for a in argv if a not in ("--liger", "--flatten")],
                        accumulates=True, usage=USAGE, packs=flatten)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
