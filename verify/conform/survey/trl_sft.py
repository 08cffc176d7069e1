#!/usr/bin/env python3
"""TRL's SFTTrainer with its default loss under streambp-conform/1: SFT, full fine-tuning, one process, a step of the
case's micro-batches (a one-batch case is a step of one micro-batch).

Usage: trl_sft.py [--padding-free] CASE_DIR

The step runs as a TRL user's does: SFTTrainer(model, args=SFTConfig(gradient_accumulation_steps=K, max_steps=1,
max_grad_norm=0, bf16=False), train_dataset=the case's rows tokenized ("input_ids", "labels": TRL's processed-dataset
form, which it neither re-tokenizes nor appends an EOS to), processing_class).train(), so TRL's compute_loss
(loss_type "nll": the token losses' sum over the Trainer's num_items_in_batch) and the Trainer's accumulation are the
ones judged. The adapter's parts, none a normalisation: the data loader yields the case's micro-batches (their sizes
differ, which a fixed batch size cannot say) of the trainer's own processed dataset, collated by its own
data_collator and prepared by its accelerator; the optimizer is a no-op whose step() copies the .grad it is handed
(clipping off).
SFTConfig's default bf16=True (autocast) is turned off: the case's dtype is the one judged. fp32 cases only: TRL's
fused LM head computes its log-probs in fp32, as HF's loss rounds the logits to fp32.
The loss reported is the Trainer's training_loss over the one step.

Packed cases (docs/packing.md): the case's sequences, cut out of its packed rows (packed_rows.py), are the dataset's
rows, and a micro-batch of packs is the micro-batch of their sequences: TRL's own collator pads them
(the default) or packs them again into one padding-free row with position_ids restarting per sequence
(--padding-free: SFTConfig(padding_free=True), the path huggingface/trl PR #4170 fixed). Where every token of every
sequence but its first is a target, the rows carry input_ids only: the language-modeling form, whose labels TRL's
collator makes itself (passing the case's labels, whose first label of each sequence is already -100, would hide a
collator that keeps it).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import protocol  # noqa: E402
import packed_rows  # noqa: E402
import trainer_step  # noqa: E402
from protocol import NotExpressible  # noqa: E402
from trl_dpo import tokenizer  # noqa: E402

USAGE = "Usage: trl_sft.py [--padding-free] CASE_DIR"


def dataset_rows(case):
    """The dataset's rows and the micro-batches of indices into them (one per micro-batch of the case)."""
    if case.packed:
        return packed_rows.sequences(case, language_modeling_form=True)
    return packed_rows.padded_rows(case)


def run(case, padding_free):
    import datasets
    import torch
    import trl

    if case.objective["name"] != "sft" or case.lora or case.ranks != 1:
        raise NotExpressible("this entry runs TRL's SFTTrainer step, full fine-tuning, one process")
    if case.dtype == torch.float64:
        raise NotExpressible("fp64: TRL's default loss (its fused LM head, trl/kernels/chunked_logprob.py) computes "
                             "the log-probs in fp32")
    rows, micro = dataset_rows(case)
    model = trainer_step.load_pinned_model(case)  # the pinned transformers' own dtype keyword
    model.train()
    extra = {"padding_free": True} if padding_free else {}
    loss, grads, seconds = trainer_step.trainer_step(
        trl.SFTTrainer,
        # SFTConfig's default bf16=True autocasts: the case's dtype is judged
        lambda out: trl.SFTConfig(**trainer_step.step_arguments(out, len(micro)), max_length=None, bf16=False,
                                  **extra),
        model, dict(model.named_parameters()), micro, train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer(model.config.vocab_size))
    return loss, {n: g.contiguous() for n, g in grads.items()}, seconds, len(micro)


def main(argv):
    padding_free = "--padding-free" in argv
    return trainer_step.main([a for a in argv if a != "--padding-free"], lambda case: run(case, padding_free), USAGE,
                             packs=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
