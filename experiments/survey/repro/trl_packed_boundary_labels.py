#!/usr/bin/env python3
"""TRL's SFTTrainer on packed / padding-free batches before and after huggingface/trl PR #4170 (released in 0.23.1):
at 0.23.0 the collator keeps the label of every packed sequence's first token, so the loss also trains each
sequence's last token to predict the next sequence's first one (and on a non-flash attention it sends an all-ones
attention_mask without position_ids: attention across the sequences). At 0.23.1 it masks those labels and sends the
restarting position_ids alone, from which transformers (>= 4.54) builds the block-diagonal mask for SDPA.

One command (the harness venv's python; the venvs are the survey's, made on first use):
    ~/.cache/streambp/venv-torch-2.14.1/bin/python experiments/survey/repro/trl_packed_boundary_labels.py

Each pin runs two settings a TRL user runs on the CPU, one optimizer step of SFTTrainer(...).train() over five
language-modeling rows (tokenized: TRL's processed-dataset form), a tiny random Qwen3 in fp64 on SDPA:
  padding_free: SFTConfig(padding_free=True), the five rows one batch;
  packing:      SFTConfig(packing=True) (its default "bfd" strategy), the five rows one pack.
The oracle, in the same venv: each row alone through the same model, the sum of its token losses over the five rows'
target count. transformers' loss rounds the logits to fp32 (ForCausalLMLoss), in the oracle as in the trainer, so
"agrees" means within 1e-6 normwise (room for that rounding; the fixed pin measures 2e-16), "differs" above 1e-3.
The buggy pin also says where its error comes from, with the model alone on the collator's own batch: its labels
with each sequence attending only to itself, and its attention inputs with the labels of the sequences' starts masked.
"""
import copy
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pins  # noqa: E402

REQUIREMENTS = ["transformers==4.56.2", "accelerate==1.10.1", "datasets==4.1.1"]  # trl 0.23.x requires >= 4.56.1
ENTRIES = [
    {"name": "trl-0.23.0-packing", "venv": "trl-0.23.0-transformers-4.56.2", "requirements": ["trl==0.23.0"] + REQUIREMENTS},
    {"name": "trl-0.23.1-packing", "venv": "trl-0.23.1-transformers-4.56.2", "requirements": ["trl==0.23.1"] + REQUIREMENTS},
]
LENGTHS = [9, 5, 12, 3, 7]  # tokens per row; 31 targets of their own, 4 boundaries when packed
VOCAB = 64
AGREE, DIFFER = 1e-6, 1e-3


def tiny_model():
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=128, initializer_range=0.2, tie_word_embeddings=False,
                                      use_cache=False, attn_implementation="sdpa")
    return transformers.Qwen3ForCausalLM(config).to(torch.float64)


def tokenizer():
    """A word-level tokenizer over the model's vocabulary: SFTTrainer wants one (its pad token); the rows are given
    tokenized, so it never tokenizes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t0", pad_token="t0")


def rows():
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]  # 0 is the pad token


def grads_of(model, loss):
    import torch

    names = [n for n, _ in model.named_parameters()]
    return dict(zip(names, torch.autograd.grad(loss, [p for _, p in model.named_parameters()])))


def oracle(model, seqs):
    """Each row alone (its own forward, the model's own loss), summed with the weight of its targets over all rows'."""
    import torch

    total = sum(len(s) - 1 for s in seqs)
    loss = 0
    for s in seqs:
        ids = torch.tensor([s])
        loss = loss + model(input_ids=ids, labels=ids).loss * (len(s) - 1) / total
    return float(loss), grads_of(model, loss)


def trainer_step(model, seqs, setting):
    """One step of SFTTrainer.train(); the optimizer keeps the gradient it is handed and changes nothing."""
    import datasets
    import torch
    import trl

    params = dict(model.named_parameters())
    seen = {}

    class Capture(torch.optim.Optimizer):
        def __init__(self, parameters):
            super().__init__(parameters, {"lr": 0.0})

        def step(self, closure=None):
            seen.update({n: p.grad.detach().clone() for n, p in params.items()})

    kind = {"padding_free": dict(padding_free=True, per_device_train_batch_size=len(seqs)),
            "packing": dict(packing=True, per_device_train_batch_size=1)}[setting]
    optimizer = Capture(model.parameters())
    with tempfile.TemporaryDirectory() as out:
        args = trl.SFTConfig(output_dir=out, max_steps=1, max_length=64, learning_rate=0.0, max_grad_norm=0.0,
                             lr_scheduler_type="constant", bf16=False, use_cpu=True, report_to=[], save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, **kind)
        trainer = trl.SFTTrainer(model=model, args=args, processing_class=tokenizer(),
                                 train_dataset=datasets.Dataset.from_list([{"input_ids": s} for s in seqs]),
                                 optimizers=(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)))
        loss = trainer.train().training_loss
    # the trainer's collator on the same rows in their order: five rows, or the one pack with its sequence lengths
    examples = ([{"input_ids": s} for s in seqs] if setting == "padding_free"
                else [{"input_ids": sum(seqs, []), "seq_lengths": [len(s) for s in seqs]}])
    return float(loss), seen, trainer.data_collator(examples)


def flat_grads(model, batch, labels, attention_inputs):
    """The model alone on the flattened row: `labels`, and either the collator's attention inputs (attention_mask,
    position_ids if any) or the restarting positions alone (each sequence attends to itself)."""
    import torch

    count = int((labels[:, 1:] != -100).sum())
    kwargs = {k: batch[k] for k in attention_inputs if k in batch}
    loss = model(input_ids=batch["input_ids"], labels=labels, num_items_in_batch=torch.tensor(count), **kwargs).loss
    return grads_of(model, loss)


def inner():
    import torch
    import trl

    seqs = rows()
    base = tiny_model()
    oracle_loss, reference = oracle(copy.deepcopy(base), seqs)
    starts = torch.cat([torch.arange(n) for n in LENGTHS])[None] == 0
    ids = torch.tensor([sum(seqs, [])])
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    out = {"trl": trl.__version__, "oracle_loss": oracle_loss}
    for setting in ("padding_free", "packing"):
        loss, grads, batch = trainer_step(copy.deepcopy(base), seqs, setting)
        error, worst = pins.normwise(grads, reference)
        own_labels = torch.where(starts, -100, ids)
        labels_only = flat_grads(copy.deepcopy(base), {"input_ids": ids, "position_ids": positions},
                                 batch["labels"], ["position_ids"])
        attention_only = flat_grads(copy.deepcopy(base), batch, own_labels, ["attention_mask", "position_ids"])
        out[setting] = {"loss": loss, "error": error, "worst": worst,
                        "batch_keys": sorted(batch), "labels_kept_at_starts": int((batch["labels"][starts] != -100).sum()),
                        "labels_only_error": pins.normwise(labels_only, reference)[0],
                        "attention_only_error": pins.normwise(attention_only, reference)[0]}
    pins.emit(out)


def outer():
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    results = [(entry, pins.run_pinned(entry, Path(__file__).resolve(), env)) for entry in ENTRIES]
    ok = True
    for (entry, r), want in zip(results, ("differs", "agrees")):
        print(f"trl {r['trl']} (oracle loss {r['oracle_loss']:.12f}):")
        for setting in ("padding_free", "packing"):
            s = r[setting]
            verdict = "agrees" if s["error"] <= AGREE else "differs" if s["error"] >= DIFFER else "unclear"
            ok &= verdict == want
            print(f"  {setting:12s} gradient {s['error']:.3e} normwise (worst {s['worst']}), loss {s['loss']:.12f}: "
                  f"{verdict}; batch {s['batch_keys']}, {s['labels_kept_at_starts']} start labels kept; "
                  f"its labels alone {s['labels_only_error']:.3e}, its attention inputs alone "
                  f"{s['attention_only_error']:.3e}")
    print("recalled: the buggy pin differs from the oracle, the fixed pin agrees" if ok else "NOT recalled")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(inner() if sys.argv[1:] == ["--inner"] else outer())
