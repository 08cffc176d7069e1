#!/usr/bin/env python3
"""LLaMA-Factory's stable SFT path (llamafactory 0.9.5, `stage: sft`, full fine-tuning) under streambp-conform/1, on
the CPU with SDPA: its dataset processor, its collator and its trainer, one optimizer step over the case's
micro-batches. Usage: llamafactory_sft.py CASE_DIR

What runs is LLaMA-Factory's, as its SFT workflow (train/sft/workflow.py) wires it:
  - a padded case: SupervisedDatasetProcessor.preprocess_dataset over the case's rows (each cut to its tokens), then
    SFTDataCollatorWith4DAttentionMask(pad_to_multiple_of=8, block_diag_attn off), which right-pads with -100 labels;
  - a packed case: `neat_packing: true` (which sets `packing`). DataArguments(neat_packing=True) and
    PackedSupervisedDatasetProcessor.preprocess_dataset over each micro-batch's sequences (cut out of the case's packed
    rows): its greedy knapsacks of at most cutoff_len - 1 tokens, position_ids restarting per sequence, the attention
    mask numbering each sequence 1, 2, ... and 0 on the padding. Then the collator with block_diag_attn on (what the
    argument parser derives from neat_packing, hparams/parser.py) turns that mask into its 4-D block-diagonal one
    (prepare_4d_attention_mask) for SDPA. cutoff_len is the multiple of 8 above the case's T, as a user sets it (2048);
    the knapsacks need not be the case's packs, which does not change the step's gradient;
  - CustomSeq2SeqTrainer (train/sft/trainer.py: its compute_loss hands the loss to transformers' Trainer, with
    num_items_in_batch), TrainingArguments and FinetuningArguments from llamafactory.hparams, remove_unused_columns
    off as the parser sets it; gradient_accumulation_steps = the case's micro-batches.
What is the adapter's: the case's token ids stand in for the template's encoding (`_encode_data_example`, which only
tokenizes a conversation), a word-level tokenizer over the model's vocabulary, the model loaded with
attn_implementation="sdpa" (LLaMA-Factory's loader would pick SDPA here too: no flash-attention on the CPU), and
trainer_step.py's loader of the micro-batches and no-op optimizer. HF's causal-LM loss rounds the logits to fp32,
so the survey runs this on fp32 cases only.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import protocol  # noqa: E402
import packed_rows  # noqa: E402
import trainer_step  # noqa: E402
from protocol import NotExpressible  # noqa: E402
from trl_dpo import tokenizer  # noqa: E402

USAGE = "Usage: llamafactory_sft.py CASE_DIR"


def process(processor, sequences):
    """processor.preprocess_dataset over `sequences` as LLaMA-Factory's aligned examples (one user turn, one
    assistant turn each), the template's encoding of example i being sequence i's ids and labels."""
    processor._encode_data_example = lambda system, **_: (sequences[int(system)]["input_ids"],
                                                          sequences[int(system)]["labels"])
    n = len(sequences)
    examples = {"_prompt": [[{"role": "user", "content": ""}]] * n,
                "_response": [[{"role": "assistant", "content": ""}]] * n,
                "_system": [str(i) for i in range(n)], "_tools": [""] * n,
                "_images": [None] * n, "_videos": [None] * n, "_audios": [None] * n}
    out = processor.preprocess_dataset(examples)
    return [{k: out[k][i] for k in out} for i in range(len(out["input_ids"]))]


def run(case):
    import torch
    from llamafactory.data import SFTDataCollatorWith4DAttentionMask
    from llamafactory.data.processor import PackedSupervisedDatasetProcessor, SupervisedDatasetProcessor
    from llamafactory.data.template import TEMPLATES
    from llamafactory.extras.constants import IGNORE_INDEX
    from llamafactory.hparams import DataArguments, FinetuningArguments, TrainingArguments
    from llamafactory.train.sft.trainer import CustomSeq2SeqTrainer

    if case.objective["name"] != "sft" or case.lora or case.ranks != 1:
        raise NotExpressible("this entry runs LLaMA-Factory's SFT step, full fine-tuning, one process")
    if case.dtype != torch.float32:
        raise NotExpressible(f"{case.dtype}: HF's causal-LM loss rounds the logits to fp32; the entry runs fp32")
    model = trainer_step.load_pinned_model(case)
    model.train()
    tok = tokenizer(model.config.vocab_size)
    template = TEMPLATES["empty"]  # no chat markup and the base multimodal plugin (text only)
    T = case.batch["input_ids"].size(1)
    if case.packed:
        data_args = DataArguments(template="empty", cutoff_len=-(-(T + 1) // 8) * 8, neat_packing=True)
        processor = PackedSupervisedDatasetProcessor(template=template, tokenizer=tok, processor=None,
                                                     data_args=data_args)
        sequences, micro_of_sequences = packed_rows.sequences(case)
        rows, micro = [], []
        for m in micro_of_sequences:  # each micro-batch's sequences packed by LLaMA-Factory's knapsacks
            packs = process(processor, [sequences[i] for i in m])
            micro.append(list(range(len(rows), len(rows) + len(packs))))
            rows += packs
    else:
        data_args = DataArguments(template="empty", cutoff_len=T)
        processor = SupervisedDatasetProcessor(template=template, tokenizer=tok, processor=None, data_args=data_args)
        cut, micro = packed_rows.padded_rows(case)
        rows = process(processor, cut)
    collator = SFTDataCollatorWith4DAttentionMask(
        template=template, model=model, pad_to_multiple_of=8, label_pad_token_id=IGNORE_INDEX,
        block_diag_attn=data_args.neat_packing, neat_packing=data_args.neat_packing,
        attn_implementation=model.config._attn_implementation, compute_dtype=case.dtype, tokenizer=tok)
    loss, grads, seconds = trainer_step.trainer_step(
        CustomSeq2SeqTrainer,
        lambda out: TrainingArguments(**trainer_step.step_arguments(out, len(micro)), remove_unused_columns=False),
        model, dict(model.named_parameters()), micro, loader_rows=rows, collate=collator, train_dataset=rows,
        finetuning_args=FinetuningArguments(stage="sft", finetuning_type="full"), processor=None, tokenizer=tok)
    return loss, {n: g.contiguous() for n, g in grads.items()}, seconds, len(micro)


def main(argv):
    return trainer_step.main(argv, run, USAGE, packs=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
