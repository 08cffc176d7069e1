#!/usr/bin/env python3
"""TRL's DPOTrainer under streambp-conform/1: DPO (sigmoid, label smoothing), full fine-tuning, one process, a step
of the case's micro-batches (a one-batch case is a step of one micro-batch).

Usage: trl_dpo.py CASE_DIR

The step runs as a TRL user's does: DPOTrainer(model, args=DPOConfig(beta, label_smoothing,
gradient_accumulation_steps=K, max_steps=1, max_grad_norm=0, precompute_ref_log_probs=True), train_dataset,
processing_class).train(), so TRL's concatenated forward, dpo_loss and compute_loss, and the Trainer's accumulation
(each micro-batch's mean, divided by K only when the Trainer decides to: transformers #35856) are the ones judged.
The adapter's parts, none a normalisation:
  - the data loader yields the case's micro-batches (their sizes differ) of tokenized pairs, with the case's
    reference log-probs as TRL's precomputed `ref_chosen_logps`/`ref_rejected_logps`, collated by the trainer's own
    data_collator and prepared by its accelerator. It does not read the train_dataset TRL tokenized in __init__ (the
    same pairs as text over a word-level tokenizer): TRL's tokenize_row appends an EOS to every completion, which
    the case's rows do not have;
  - the optimizer is a no-op whose step() copies the .grad it is handed (clipping off: max_grad_norm=0; both in
    trainer_step.py).
The loss reported is the Trainer's training_loss over the one step.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import protocol  # noqa: E402
import trainer_step  # noqa: E402
from protocol import CaseError, NotExpressible  # noqa: E402

USAGE = "Usage: trl_dpo.py CASE_DIR"


def load(case):
    import torch

    if case.dtype == torch.float64:
        protocol.fp64_exact()
    return trainer_step.load_pinned_model(case)


def tokenizer(vocab_size):
    """A word-level tokenizer over the model's vocabulary (t0 .. t{V-1}): DPOTrainer insists on one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t0", pad_token="t0")


def pairs(case):
    """The case's pairs as TRL's tokenized rows: pair i is row i (chosen) and row P + i (rejected) of one prompt."""
    b = case.batch
    if "completion_mask" not in b or "ref_logps" not in b:
        raise CaseError("dpo: batch.safetensors needs 'completion_mask' and 'ref_logps'")
    P = b["input_ids"].size(0) // 2

    def split(r):
        ids, att, comp = b["input_ids"][r], b["attention_mask"][r].bool(), b["completion_mask"][r].bool()
        n, p = int(att.sum()), int((att & ~comp).sum())
        if not (att[:n].all() and not comp[:p].any() and comp[p:n].all() and not comp[n:].any()):
            raise CaseError(f"dpo: row {r} is not prompt, completion, right padding")
        return ids[:p].tolist(), ids[p:n].tolist()

    out = []
    for i in range(P):
        (prompt, chosen), (prompt_l, rejected) = split(i), split(P + i)
        if prompt != prompt_l:
            raise NotExpressible(f"dpo: pair {i}'s rows have different prompts; TRL's pairs share one")
        out.append({"prompt_input_ids": prompt, "chosen_input_ids": chosen, "rejected_input_ids": rejected,
                    "ref_chosen_logps": b["ref_logps"][i], "ref_rejected_logps": b["ref_logps"][P + i]})
    return out


def run(case):
    import datasets
    import trl

    if case.objective["name"] != "dpo" or case.lora or case.ranks != 1:
        raise NotExpressible("this entry runs TRL's DPOTrainer step, full fine-tuning, one process")
    if case.objective.get("loss_type", "sigmoid") != "sigmoid":
        raise NotExpressible(f"dpo: loss_type {case.objective.get('loss_type')} (this entry runs sigmoid)")
    rows = pairs(case)
    P = len(rows)
    # the case's micro-batches list rows (chosen i and rejected P + i together); the loader yields pairs
    micro = [sorted({r % P for r in m}) for m in case.micro_batches] if case.micro_batches else [list(range(P))]
    for m, rows_of in zip(micro, case.micro_batches or [range(2 * P)]):
        if sorted(rows_of) != sorted(m + [i + P for i in m]):
            raise NotExpressible(f"micro-batch {list(rows_of)} splits a pair: TRL's batches hold whole pairs")
    model = load(case)
    text = datasets.Dataset.from_list([{k: " ".join(f"t{t}" for t in r[f"{k}_input_ids"])
                                        for k in ("prompt", "chosen", "rejected")} for r in rows])
    dpo = dict(beta=float(case.objective.get("beta", 0.1)), loss_type="sigmoid", precompute_ref_log_probs=True,
               label_smoothing=float(case.objective.get("label_smoothing", 0.0)))
    loss, grads, seconds = trainer_step.trainer_step(
        trl.DPOTrainer, lambda out: trl.DPOConfig(**trainer_step.step_arguments(out, len(micro)), **dpo),
        model, dict(model.named_parameters()), micro, loader_rows=rows, train_dataset=text,
        processing_class=tokenizer(model.config.vocab_size))
    return loss, {n: g.contiguous() for n, g in grads.items()}, seconds, len(micro)


def main(argv):
    return trainer_step.main(argv, run, USAGE)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
