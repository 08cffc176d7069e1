"""A packed case's sequences as the survey's adapters hand them to a library: cut out of the rows (trl_sft.py, which
gives TRL the sequences and lets its own collator pack them), or kept packed with a block-diagonal mask for a
transformers that predates packing detection from position_ids (liger_adapter.py --rope-only).

A packed row (docs/packing.md): sequences back to back, position_ids restarting at 0 at each one's first token,
attention_mask 1 on every sequence's tokens and 0 on the padding after the row's last one (a ragged last pack); the
package's Case gives each row's sequence lengths (Case.sequences) and the boundaries in both forms."""
from protocol import CaseError


def spans(case):
    """Per row, the [start, end) of each of its sequences (Case.sequences: the package checks them against
    position_ids and cu_seqlens; a ragged row's padding is in none)."""
    if not getattr(case, "packed", False):
        raise CaseError("not a packed case (case.json has no packed: true)")
    out = []
    for lengths in case.sequences:
        ends = [sum(lengths[:i + 1]) for i in range(len(lengths))]
        out.append(list(zip([0] + ends[:-1], ends)))
    return out


def is_language_modeling(case, row_spans):
    """True when every token of every sequence but its first is a target: what transformers'
    DataCollatorWithFlattening (and TRL's collators on a dataset without labels) write for such sequences."""
    ids, labels = case.batch["input_ids"], case.batch["labels"]
    return all(bool((labels[r][s + 1:e] == ids[r][s + 1:e]).all())
               for r, row in enumerate(row_spans) for s, e in row)


def sequences(case, language_modeling_form=False):
    """The case's sequences one per dataset row, row after row ({"input_ids", "labels"}; with
    `language_modeling_form`, input_ids alone where is_language_modeling holds), and the case's micro-batches as lists
    of their indices (a micro-batch of packs is the micro-batch of their sequences, in order)."""
    row_spans = spans(case)
    lm = language_modeling_form and is_language_modeling(case, row_spans)
    ids, labels = case.batch["input_ids"], case.batch["labels"]
    rows, of_pack = [], []
    for r, row in enumerate(row_spans):
        of_pack.append([])
        for s, e in row:
            of_pack[-1].append(len(rows))
            rows.append({"input_ids": ids[r][s:e].tolist()} if lm else
                        {"input_ids": ids[r][s:e].tolist(), "labels": labels[r][s:e].tolist()})
    micro = case.micro_batches or [list(range(len(row_spans)))]
    return rows, [[i for r in m for i in of_pack[r]] for m in micro]


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


def padded_rows(case):
    """An unpacked case's rows cut to their tokens ({"input_ids", "labels"}: each right-padded row's first
    attention_mask.sum() positions) and its micro-batches of row indices (all rows when it has none), as the dataset
    rows a trainer's own collator pads again (trl_sft.py, llamafactory_sft.py)."""
    b = case.batch
    rows = []
    for r in range(b["input_ids"].size(0)):
        n = int(b["attention_mask"][r].sum())
        if not b["attention_mask"][r][:n].all():
            raise CaseError(f"sft: row {r} is not right-padded")
        rows.append({"input_ids": b["input_ids"][r][:n].tolist(), "labels": b["labels"][r][:n].tolist()})
    return rows, case.micro_batches or [list(range(len(rows)))]
