#!/usr/bin/env python3
"""Liger-Kernel's RoPE on a micro-batch of packed rows before and after linkedin/Liger-Kernel PR #477 (released in
0.5.3): up to 0.5.2 the kernel indexes cos/sin by the position in the row only (pid % seq_len), so when they come
with one row per batch row ([B, T, head_dim], as the model's rotary embedding makes them from position_ids [B, T])
every row is rotated with row 0's positions. Packed rows restart their positions at different places, so each row
after the first is rotated at positions that are not its own.

One command (the harness venv's python; the venvs are the survey's, made on first use):
    ~/.cache/streambp/venv-torch-2.14.1/bin/python experiments/survey/repro/liger_rope_packed_rows.py

The setting: apply_liger_kernel_to_qwen2(rope=True) alone (its other kernels off, so RoPE is the only Liger code),
transformers 4.47.1 (December 2024, the fixed release's time), a tiny random Qwen2 in fp64 on SDPA, one micro-batch of
two packed rows (sequences of 5 + 7 and 4 + 8 tokens) given as the CPU's attention takes packing at that
transformers: position_ids restarting per sequence and a 4-D block-diagonal causal mask (0 where a query may look,
the dtype's minimum elsewhere), as LLaMA-Factory's neat_packing builds it. The kernels run in Triton's CPU interpreter
(TRITON_INTERPRET=1): the algorithm, not a GPU's numerics. The loss, the same for both runs, is each sequence's
token cross-entropy sum in fp64 over the batch's target count; the oracle is each sequence alone through the same
patched model (its rotary embedding then [1, T, head_dim], the kernel's row-0 case). "agrees": within 1e-10
normwise, "differs": above 1e-3. The error is also split by row: row 0's sequences are right at both pins.
"""
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pins  # noqa: E402

ENTRIES = [
    {"name": "liger-0.5.2-rope-packed", "venv": "liger-0.5.2-transformers-4.47.1",
     "requirements": ["liger-kernel==0.5.2", "transformers==4.47.1"]},
    {"name": "liger-0.5.3-rope-packed", "venv": "liger-0.5.3-transformers-4.47.1",
     "requirements": ["liger-kernel==0.5.3", "transformers==4.47.1"]},
]
PACKS = [[5, 7], [4, 8]]  # sequence lengths per packed row; both rows T = 12
VOCAB = 64
AGREE, DIFFER = 1e-10, 1e-3


def tiny_model():
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      initializer_range=0.2, tie_word_embeddings=False, use_cache=False,
                                      attn_implementation="sdpa")
    return transformers.Qwen2ForCausalLM(config).to(torch.float64)


def packed_batch():
    """input_ids, position_ids [B, T] and the additive block-diagonal causal mask [B, 1, T, T]; the sequences."""
    import torch

    g = torch.Generator().manual_seed(1)
    seqs = [[torch.randint(0, VOCAB, (n,), generator=g) for n in pack] for pack in PACKS]
    ids = torch.stack([torch.cat(row) for row in seqs])
    positions = torch.stack([torch.cat([torch.arange(len(s)) for s in row]) for row in seqs])
    segment = torch.stack([torch.cat([torch.full((len(s),), i) for i, s in enumerate(row)]) for row in seqs])
    T = ids.size(1)
    allowed = (segment[:, :, None] == segment[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    return ids, positions, mask[:, None], seqs


def sequence_losses(logits, seqs_of_row):
    """Per sequence of one row: the sum of its own next-token cross-entropies (fp64), from that row's logits [T, V]."""
    import torch.nn.functional as F

    out, start = [], 0
    for s in seqs_of_row:
        n = len(s)
        out.append(F.cross_entropy(logits[start:start + n - 1], s[1:], reduction="sum"))
        start += n
    return out


def grads_of(model, loss):
    import torch

    # the graph is kept: the packed forward's is differentiated again per row
    return dict(zip([n for n, _ in model.named_parameters()],
                    torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)))


def inner():
    import os
    from importlib.metadata import version

    import transformers
    from liger_kernel.transformers import apply_liger_kernel_to_qwen2

    apply_liger_kernel_to_qwen2(rope=True, cross_entropy=False, fused_linear_cross_entropy=False, rms_norm=False,
                                swiglu=False)
    base = tiny_model()
    ids, positions, mask, seqs = packed_batch()
    total = sum(len(s) - 1 for row in seqs for s in row)
    packed = copy.deepcopy(base)
    logits = packed(input_ids=ids, attention_mask=mask, position_ids=positions).logits  # [B, T, V]
    row_losses = [sum(sequence_losses(logits[b], seqs[b])) / total for b in range(len(seqs))]
    alone = copy.deepcopy(base)
    alone_losses = [sum(sequence_losses(alone(input_ids=s[None]).logits[0], [s])[0] for s in row) / total
                    for row in seqs]
    out = {"liger": version("liger-kernel"), "transformers": transformers.__version__,
           "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1", "loss": float(sum(row_losses)), "oracle_loss": float(sum(alone_losses))}
    error, worst = pins.normwise(grads_of(packed, sum(row_losses)), grads_of(alone, sum(alone_losses)))
    out.update(error=error, worst=worst)
    for b in range(len(seqs)):  # each row's sequences alone: which rows the kernel rotates wrongly
        out[f"row{b}_error"] = pins.normwise(grads_of(packed, row_losses[b]), grads_of(alone, alone_losses[b]))[0]
    pins.emit(out)


def outer():
    results = [pins.run_pinned(entry, Path(__file__).resolve(), {"TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"})
               for entry in ENTRIES]
    ok = True
    for r, want in zip(results, ("differs", "agrees")):
        verdict = "agrees" if r["error"] <= AGREE else "differs" if r["error"] >= DIFFER else "unclear"
        ok &= verdict == want
        print(f"liger-kernel {r['liger']} (transformers {r['transformers']}, Triton interpreter "
              f"{r['triton_interpret']}): gradient {r['error']:.3e} normwise (worst {r['worst']}): {verdict}; "
              f"row 0 alone {r['row0_error']:.3e}, row 1 alone {r['row1_error']:.3e}; "
              f"loss {r['loss']:.15f} (oracle {r['oracle_loss']:.15f})")
    print("recalled: the buggy pin differs from the oracle, the fixed pin agrees" if ok else "NOT recalled")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(inner() if sys.argv[1:] == ["--inner"] else outer())
