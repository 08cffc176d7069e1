#!/usr/bin/env python3
"""torchtitan's chunked loss (ChunkedLossWrapper over its CrossEntropyLoss) under streambp-conform/1: HF's decoder for
the body, torchtitan's loss for the LM head and the loss, SFT, one process, a step of the case's micro-batches.

Usage: torchtitan_loss.py [--context-parallel] CASE_DIR

The step is torchtitan 0.3.0's Trainer.train_step (trainer.py) with its model swapped for HF's:
- global_valid_tokens, the step's count of labels != IGNORE_INDEX, is counted over every micro-batch before any
  forward (train_step), and each micro-batch's loss is called with it (forward_backward_step);
- the model runs with _skip_lm_head (the trainer sets it for ChunkedLossWrapper): the decoder's normed hidden states
  [B, T, d] go to the wrapper, whose set_lm_head got the model's lm_head (tied or not, HF's own module);
- loss, _ = loss_fn(pred, labels, global_valid_tokens); loss.backward() per micro-batch, the gradients accumulating in
  .grad as the trainer's do before its optimizer step (clipping, max_norm, left out: the gradient is judged).
The adapter's parts, none a normalisation: the labels are shifted as torchtitan's data loader shifts them (position t's
label is token t + 1, the last position IGNORE_INDEX), and the chunk count is the wrapper's default 8 when it divides
T, else the largest count below 8 that does (the wrapper requires equal chunks; T = 300: 6).
--context-parallel declines every case: torchtitan's context parallelism for SDPA attention is torch's context_parallel,
which on 2 Gloo ranks on the CPU stops at torch 2.14.1's missing sharding rule for the CPU SDPA kernel (docs/survey.md);
the survey's entry for it is therefore marked as needing a GPU, and this flag keeps a GPU run from passing off the
one-process path as it.
fp32 and bf16 only: torchtitan computes the loss from fp32 logits (`.float()` in cross_entropy_loss) and holds the
hidden states' gradient in fp32 (GradAccumulator), so an fp64 case would judge its fp32 arithmetic, not its algorithm.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import protocol  # noqa: E402
from protocol import NotExpressible  # noqa: E402

USAGE = "Usage: torchtitan_loss.py [--context-parallel] CASE_DIR"
DEFAULT_CHUNKS = 8  # ChunkedLossWrapper.Config.num_chunks


def chunk_count(T):
    """The wrapper's default chunk count, or the largest one below it that splits T into equal chunks."""
    return max(n for n in range(1, DEFAULT_CHUNKS + 1) if T % n == 0)


def shifted_labels(labels):
    """[B, T] HF labels (token t at t) -> [B, T] torchtitan labels (token t + 1 at t, IGNORE_INDEX at the end)."""
    import torch.nn.functional as F
    from torchtitan.components.loss import IGNORE_INDEX

    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def titan_loss(model, case):
    from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper

    b = case.batch
    step = case.union if case.union is not None else b  # train_step counts the step's labels before any forward
    global_valid_tokens = (shifted_labels(step["labels"]) != IGNORE_INDEX).sum()
    base = model.get_base_model() if case.lora else model
    loss_fn = ChunkedLossWrapper(ChunkedLossWrapper.Config(num_chunks=chunk_count(b["input_ids"].size(1))))
    loss_fn.set_lm_head(base.lm_head)
    # pred: [B, T, d], the decoder's normed output (torchtitan's model with _skip_lm_head)
    pred = base.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
    loss, _ = loss_fn(pred, shifted_labels(b["labels"]), global_valid_tokens)
    return loss  # protocol.run_step calls loss.backward(), as _forward_backward_body does


def step(case):
    import torch

    if case.dtype == torch.float64:
        raise NotExpressible("fp64: torchtitan's cross_entropy_loss computes the loss from fp32 logits (.float()) and "
                             "GradAccumulator holds the hidden states' gradient in fp32")
    model, trainable = protocol.load_model(case)
    return protocol.run_step(case, model, trainable, titan_loss)


def context_parallel_step(case):
    raise NotExpressible("context parallelism: this adapter runs torchtitan's loss in one process; torch 2.14.1's "
                         "context_parallel has no sharding rule for the CPU SDPA kernel, so it was not wired in")


if __name__ == "__main__":
    argv = sys.argv[1:]
    cp = "--context-parallel" in argv
    sys.exit(protocol.run(context_parallel_step if cp else step, [a for a in argv if a != "--context-parallel"],
                          accumulates=True, distributed=cp, objectives={"sft"}, usage=USAGE))
