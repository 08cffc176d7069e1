"""A packed case's sequences as the survey's adapters hand them to a library: cut out of the rows (trl_sft.py, which
gives TRL the sequences and lets its own collator pack them), or kept packed with a block-diagonal mask for a
transformers that predates packing detection from position_ids (liger_adapter.py --rope-only).

A packed row (docs/packing.md): sequences back to back, position_ids restarting at 0 at each one's first token,
attention_mask 1 on every sequence's tokens and 0 on the padding after the row's last one (a ragged last pack)."""
from protocol import CaseError


def spans(case):
    """Per row, the [start, end) of each of its sequences, from position_ids' restarts inside attention_mask."""
    b = case.batch
    if "position_ids" not in b:
        raise CaseError("a packed case without position_ids in batch.safetensors")
    out = []
    for r in range(b["input_ids"].size(0)):
        n = int(b["attention_mask"][r].sum())
        if not b["attention_mask"][r][:n].all():
            raise CaseError(f"row {r}: padding between packed sequences (attention_mask 0 before position {n})")
        positions = b["position_ids"][r][:n].tolist()
        starts = [t for t in range(n) if positions[t] == 0]
        if n and starts[:1] != [0]:
            raise CaseError(f"row {r}: position_ids[0] is {positions[0]}, a packed row starts a sequence at 0")
        out.append(list(zip(starts, starts[1:] + [n])))
    return out


def is_language_modeling(case, row_spans):
    """True when every token of every sequence but its first is a target: what transformers'
    DataCollatorWithFlattening (and TRL's collators on a dataset without labels) write for such sequences."""
    ids, labels = case.batch["input_ids"], case.batch["labels"]
    return all(bool((labels[r][s + 1:e] == ids[r][s + 1:e]).all())
               for r, row in enumerate(row_spans) for s, e in row)


def sequences(case):
    """The case's sequences one per dataset row ({"input_ids"} in the language-modeling form, else with "labels"),
    and each packed row's sequence indices (a micro-batch of packs is the micro-batch of their sequences)."""
    row_spans = spans(case)
    lm = is_language_modeling(case, row_spans)
    ids, labels = case.batch["input_ids"], case.batch["labels"]
    rows, of_pack = [], []
    for r, row in enumerate(row_spans):
        of_pack.append([])
        for s, e in row:
            of_pack[-1].append(len(rows))
            rows.append({"input_ids": ids[r][s:e].tolist()} if lm else
                        {"input_ids": ids[r][s:e].tolist(), "labels": labels[r][s:e].tolist()})
    return rows, of_pack


def block_mask(case, dtype):
    """The additive causal mask [B, 1, T, T] that keeps each query inside its own sequence: 0 where it may look, the
    dtype's minimum elsewhere (padding rows look at themselves only, so no row of the softmax is empty)."""
    import torch

    B, T = case.batch["input_ids"].shape
    segment = torch.full((B, T), -1, dtype=torch.long)
    for r, row in enumerate(spans(case)):
        for i, (s, e) in enumerate(row):
            segment[r, s:e] = i
    pad = segment < 0
    segment[pad] = -1 - torch.arange(T).expand(B, T)[pad]  # each padding position a segment of its own
    allowed = (segment[:, :, None] == segment[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    mask = torch.zeros((B, T, T), dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[:, None]
