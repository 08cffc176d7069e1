#!/usr/bin/env python3
"""axolotl's multipack without sequence parallelism (axolotl 0.19.0, `sample_packing: true`, attn_implementation sdpa)
on the CPU, under streambp-conform/1: packed cases only. Usage: axolotl_multipack.py CASE_DIR

What is axolotl's: its collator for packed batches, V2BatchSamplerDataCollatorForSeq2Seq
(utils/collators/batching.py), which concatenates each bin's samples into one row with their position_ids (restarting
at 0 per sample) and pads the row, position_ids of the padding counting 0, 1, ... as a sample of its own and labels
-100; built as its causal builder builds it (core/builders/causal.py build_collator: the V2 collator for a Llama off
flash-attention; padding to a multiple of 64 x ceil(sequence_len / 64), the pad_to_sequence_len its validation turns
on for sample_packing). On SDPA axolotl drops the attention mask so that transformers builds the block-diagonal mask
from position_ids (utils/schemas/config.py attn_decontaminates_packing -> sample_packing_drop_attention_mask;
core/trainers/base.py removes the dataset's attention_mask column): the samples here carry none, as after that removal.
With SDPA its sampler yields real batches of bins (multipack_real_batches), one row per bin.
What is the adapter's: the bins are the case's packs (its multipack sampler would choose its own; the step's gradient
does not depend on the packing), and the step is transformers' Trainer, to which AxolotlTrainer.compute_loss hands
the loss (core/trainers/base.py), through trainer_step.py's loader and no-op optimizer. fp32 cases only: HF's
causal-LM loss rounds the logits to fp32.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import packed_rows  # noqa: E402
import trainer_step  # noqa: E402
from protocol import NotExpressible  # noqa: E402
from trl_dpo import tokenizer  # noqa: E402

USAGE = "Usage: axolotl_multipack.py CASE_DIR"


def run(case):
    import math

    import torch
    import transformers
    from axolotl.utils.collators.batching import V2BatchSamplerDataCollatorForSeq2Seq

    if case.objective["name"] != "sft" or case.lora or case.ranks != 1:
        raise NotExpressible("this entry runs axolotl's multipack SFT step, full fine-tuning, one process")
    if not case.packed:
        raise NotExpressible("axolotl's multipack: packed cases only")
    if case.dtype != torch.float32:
        raise NotExpressible(f"{case.dtype}: HF's causal-LM loss rounds the logits to fp32; the entry runs fp32")
    model = trainer_step.load_pinned_model(case)
    model.train()
    sequences, _ = packed_rows.sequences(case)
    bins, k = [], 0  # one bin per packed row of the case, its samples as axolotl's tokenized rows
    for lengths in case.sequences:
        bins.append([{**sequences[k + i], "position_ids": list(range(len(sequences[k + i]["input_ids"])))}
                     for i in range(len(lengths))])
        k += len(lengths)
    micro = case.micro_batches or [list(range(len(bins)))]
    T = case.batch["input_ids"].size(1)
    collator = V2BatchSamplerDataCollatorForSeq2Seq(tokenizer(model.config.vocab_size), padding=True,
                                                    pad_to_multiple_of=64 * math.ceil(T / 64), return_tensors="pt")
    loss, grads, seconds = trainer_step.trainer_step(
        transformers.Trainer,
        lambda out: transformers.TrainingArguments(**trainer_step.step_arguments(out, len(micro)),
                                                   remove_unused_columns=False),
        model, dict(model.named_parameters()), micro, loader_rows=bins, collate=collator, train_dataset=bins)
    return loss, {n: g.contiguous() for n, g in grads.items()}, seconds, len(micro)


def main(argv):
    return trainer_step.main(argv, run, USAGE, packs=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
