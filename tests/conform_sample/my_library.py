"""The sample project's library (docs/conform-in-ci.md): an HF checkpoint and a chunked causal-LM loss, the LM head
and its cross-entropy over `chunk` positions at a time, so that the [B, T, V] logits never exist at once.

SAMPLE_LOSS=chunk-shift plants the bug conform must catch (tests/cli/cli_conform_pytest.sh): each chunk shifted on
its own after the split, so that the target crossing each head-tile boundary (a chunk's last position predicting the
next chunk's first token) is lost."""
import os

import torch
import torch.nn.functional as F
import transformers


def load(model_dir, dtype):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)


def loss(model, batch, chunk):
    """The mean token loss over the batch's targets (labels -100: not a target), chunk by chunk: each chunk's summed
    token losses, divided once by the batch's target count."""
    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    weight = model.lm_head.weight  # [V, d]; a tied head is the embedding, its gradient the sum of both uses
    if os.environ.get("SAMPLE_LOSS") == "chunk-shift":
        return _chunk_shifted(hidden, weight, batch["labels"], chunk)
    targets = _next_tokens(batch["labels"])  # shifted once, before the split
    total = sum(_summed(hidden[:, s:s + chunk], weight, targets[:, s:s + chunk])
                for s in range(0, hidden.size(1), chunk))
    return total / (targets != -100).sum()


def _next_tokens(labels):
    """Position t predicts token t + 1; the last position predicts nothing."""
    return F.pad(labels, (0, 1), value=-100)[:, 1:]


def _summed(hidden, weight, targets):
    logits = hidden @ weight.T  # [B, c, V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # as HF's loss: at least fp32
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")


def _chunk_shifted(hidden, weight, labels, chunk):
    """The bug: the shift inside each chunk, over the targets it kept."""
    total, count = 0, 0
    for s in range(0, hidden.size(1), chunk):
        targets = _next_tokens(labels[:, s:s + chunk])
        total, count = total + _summed(hidden[:, s:s + chunk], weight, targets), count + (targets != -100).sum()
    return total / count
