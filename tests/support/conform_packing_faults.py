"""Packing bugs `streambp conform` must catch on its packed cases (issue #59), on HF like verify/conform/hf_adapter.py
(fp64 kept fp64, HF's own loss), each one mistake a packing path makes. MODE:
  cross-boundary  the row's attention_mask only (ones on the tokens), position_ids ignored: HF builds a plain causal
                  mask and every sequence attends to the ones packed before it;
  positions       the block-diagonal causal mask of the boundaries (cu_seqlens), but position_ids 0..T-1 along the row
                  instead of restarting per sequence: RoPE is relative, so each sequence is only rotated by a constant
                  offset, which moves its scores through the rounding of the larger angles alone (HF computes them in
                  fp32: ~1e-7, far above the fp64 bar);
  separator       HF's packed path, but the first label of one sequence (row 0's second) kept: the last token of the
                  sequence before it is trained to predict it, as TRL before PR #4170 did.
Packed GRPO's (docs/packing.md "GRPO on packed rows"), HF's packed path with TRL's formulas (losses.py) but one
per-sequence term per row (pack):
  row-advantage   each completion token takes its row's first sequence's advantage (one advantage per pack, as a
                  padded layout gives them);
  pack-normaliser each pack counted as one completion: grpo's token mean (and the sequence-level ratio) over the
                  whole pack, grpo's and dr_grpo's count of completions the step's rows.
Usage: PYTHON conform_packing_faults.py MODE CASE_DIR
"""
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "verify" / "conform"))
from streambp_conform.warm import delegate  # noqa: E402

delegate()  # in a warm worker when STREAMBP_CONFORM_WARM names a server (streambp_conform/warm.py)
import torch  # noqa: E402

import losses  # noqa: E402
import protocol  # noqa: E402

MODES = ("cross-boundary", "positions", "separator", "row-advantage", "pack-normaliser")
GRPO_MODES = ("row-advantage", "pack-normaliser")


def block_causal_mask(position_ids):
    """[B, 1, T, T] bool, True where query t may see key s: the same segment of position_ids and s <= t."""
    segment = (position_ids == 0).cumsum(-1)  # [B, T]: which segment each token is in
    T = position_ids.size(1)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return ((segment.unsqueeze(-1) == segment.unsqueeze(-2)) & causal).unsqueeze(1)


def faulty_batch(mode, case):
    """The case's batch as the fault hands it to HF: the keys of losses.batch_inputs (position_ids: packed) changed."""
    b = dict(case.batch)
    if mode == "cross-boundary":
        del b["position_ids"]  # losses.batch_inputs then passes attention_mask: a plain causal mask over the row
    elif mode == "positions":
        mask = block_causal_mask(b.pop("position_ids"))
        b["attention_mask"] = mask  # a 4-D mask: HF takes it as given
    elif mode == "separator":
        start = case.sequences[0][0]  # row 0's second sequence
        b["labels"] = b["labels"].clone()
        b["labels"][0, start] = b["input_ids"][0, start]
    return b


def main(argv):
    if len(argv) != 2 or argv[0] not in MODES:
        print(f"Usage: conform_packing_faults.py {'|'.join(MODES)} CASE_DIR", file=sys.stderr)
        return 2
    mode = argv[0]
    original = losses.batch_inputs

    def inputs(b):  # what the fault's model sees in place of losses.batch_inputs' packed inputs
        if mode == "positions":
            T = b["input_ids"].size(1)
            return {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"], "use_cache": False,
                    "position_ids": torch.arange(T).expand_as(b["input_ids"])}
        return original(b)

    losses.batch_inputs = inputs
    if mode == "row-advantage":
        losses.position_advantages = lambda case, dtype: (
            case.batch["advantages"].to(dtype)[case.sequence_ids[:, :1]].expand(-1, case.sequence_ids.size(1) - 1))
    elif mode == "pack-normaliser":
        rows_of = lambda case: torch.arange(case.sequence_ids.size(0)).unsqueeze(1).expand(-1, case.sequence_ids.size(1) - 1)  # noqa: E731
        losses.completion_groups = lambda case: (rows_of(case), case.sequence_ids.size(0))
        losses.step_completions = lambda step: step["input_ids"].size(0)

    def step(case):
        if not case.packed or len(case.sequences[0]) < 2:
            raise protocol.NotExpressible("the packing faults need a packed case whose row 0 holds 2 sequences")
        if (mode in GRPO_MODES) != losses.packed_grpo(case):
            raise protocol.NotExpressible(f"{mode}: a fault of packed {'GRPO' if mode in GRPO_MODES else 'SFT'} rows")
        model, trainable = protocol.load_model(case)
        wrong = replace(case, batch=faulty_batch(mode, case))
        loss, grads, seconds = protocol.run_step(wrong, model, trainable, losses.loss)
        return protocol.Result(loss, grads, seconds)

    return protocol.run(step, argv[1:], accumulates=True, packs=("sft", "grpo"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
