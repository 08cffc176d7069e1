#!/usr/bin/env python3
"""TRL's GRPOTrainer under streambp-conform/1: whole RL steps (`streambp conform --cases rl`, docs/rl-steps.md), in
fp64, through its own train().

Usage: trl_grpo.py CASE_DIR

From the case's generation batch to the gradient its optimizer receives at every optimizer step, TRL runs its own
code: the left-padded prompts, the mask after the first EOS, the rewards' weights and scale_rewards, the micro-batches
(steps_per_generation, gradient accumulation, num_iterations), old log-probs, the clipped objective, the KL term and
each loss_type's normaliser. What the adapter replaces, and nothing else, is streambp_conform.trl_grpo's (generation,
the reward models, the fused head by TRL's own log-softmax on the fp64 logits, SGD without clipping, and TRL's random
shuffle by the case's micro_batches). It returns TRL's advantages, completion mask and per-token log-probs at
generation time beside the gradients, so that a failure names the stage. Declines every case that is not an RL step,
and a setting the installed TRL lacks (trl_grpo.Pin). The loss is not reported (conform does not judge an RL step's).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from streambp_conform.warm import delegate  # noqa: E402

delegate()  # in a warm worker when STREAMBP_CONFORM_WARM names a server (streambp_conform/warm.py)
import protocol  # noqa: E402
from streambp_conform import rl, trl_grpo  # noqa: E402


def step(case, hooks=None):
    protocol.quiet_hf()
    protocol.fp64_exact()
    record = trl_grpo.train(case.rl, case.model_dir, hooks=hooks)
    return 0.0, rl.returned_tensors(case.rl, record)


if __name__ == "__main__":
    sys.exit(protocol.run(step, rl_steps=True, usage="Usage: trl_grpo.py CASE_DIR"))
