#!/usr/bin/env python3
"""The harness's reference adapter: HF Transformers (and PEFT under LoRA) with standard backprop, or with HF's
gradient checkpointing (`--gradient-checkpointing`: activation_checkpointing_enable + train mode; dropout is 0).
`streambp conform --impl hf|hf-checkpointing` runs it; it must pass every case.

Usage: hf_adapter.py [--gradient-checkpointing] CASE_DIR   (protocol: streambp_conform via protocol.py; losses: losses.py)
fp64 cases stay fp64 end to end (RMSNorm patched, SFT loss without HF's fp32 cast of the logits), so they are
judged at 1e-10 against the harness's fp64 standard BP; fp32 and bf16 cases run HF as shipped. A micro-batch case
runs as HF's Trainer accumulates: a forward + backward per micro-batch, each loss over the step's target count.
Packed rows take HF's own packed path: position_ids restarting per sequence and no attention_mask, from which
transformers builds the block-diagonal causal mask (streambp_conform.hf.model_inputs); packed GRPO's terms are per
sequence (losses.py: its advantage, the sequence ratio, grpo's mean and count).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from streambp_conform.warm import delegate  # noqa: E402

delegate()  # in a warm worker when STREAMBP_CONFORM_WARM names a server (streambp_conform/warm.py)
import losses  # noqa: E402
import protocol  # noqa: E402

if __name__ == "__main__":
    # accumulates: a micro-batch case runs its micro-batches, each normalised by the step's totals (losses.step_batch);
    # packs: packed rows go to HF's own packed path (position_ids, no attention_mask: losses.forward_logits), SFT's
    # and GRPO's (its per-sequence terms: losses.grpo_per_token)
    sys.exit(protocol.main(sys.argv[1:], losses.loss, "Usage: hf_adapter.py [--gradient-checkpointing] CASE_DIR",
                           accumulates=True, packs=("sft", "grpo")))
