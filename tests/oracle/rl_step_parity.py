"""Whole GRPO steps: TRL's own GRPOTrainer.train() (the pinned trl, 1.16.0) against our RL step oracle
(`streambp rl-step`, verify/rl_step_oracle.h, docs/rl-steps.md), in fp64, on hand-made tiny cases.

The adapter's side is the package's (verify/conform/streambp_conform/rl.py, and trl_grpo.py, which drives TRL; the
conform adapter verify/conform/survey/trl_grpo.py runs the same driver). TRL runs its own code from the generation batch to the optimizer: left-padding, masking after the first EOS, the
rewards' weights, the advantages (scale_rewards), the micro-batches (steps_per_generation, gradient accumulation,
num_iterations, its shuffle), old log-probs, the clipped objective, the KL term and each loss_type's normaliser. Only
these are replaced, and nothing else:
  - generation: the model's `generate` returns the case's raw completions (tokens after the EOS included, so that
    TRL's own mask must drop them), appended to TRL's left-padded prompts;
  - the reward models: one function per reward column, returning the case's value for (prompt, completion);
  - the fused LM head (fp32 tiles inside, trl_oracle.py) by TRL's own unfused selective_log_softmax_and_entropy on
    the fp64 logits, behind the same call contract, so that the comparison can be exact;
  - the positions: HF's Qwen3 makes its RoPE table in fp32, so a left-padded row whose positions start at its pads
    (TRL passes no position_ids) differs from the unpadded sequence by rounding alone (5e-8 normwise on these cases,
    measured); the head passes each row the positions of its unpadded sequence (cumsum(attention_mask) - 1), which
    RoPE's invariance to a shift makes the same function in exact arithmetic;
  - the optimizer: plain SGD at a constant learning rate, no clipping (max_grad_norm 0);
  - torch's default dtype is fp64 while TRL runs: TRL builds its reward table with it (fp32 by default), and the
    cases' rewards and weights are exact in fp32, so nothing is rounded.
TRL shuffles the generation batch before cutting it into micro-batches: the script records TRL's permutation and
hands it to our oracle as the case's micro_batches. The gradient TRL's optimizer receives at every optimizer step
must equal ours (normwise <= 1e-10 per tensor), and TRL's advantages, completion mask and per-token log-probs at
generation time (TRL's own log-prob pass over the generation batch it hands its loss, where the loss scores) ours.

Negative controls (CTest): STREAMBP_RL_FAULT scales the gradient TRL handed the optimizer at its last step, and the
script must fail naming that step and a tensor (rl_step_parity_fault). STREAMBP_RL_TRL_BUG plants a bug in the trainer
(tests/support/rl_trainer_bugs.py), in what TRL's _generate_and_score_completions hands its loss: `eos` drops each row's EOS from the completion mask
(rl_step_parity_eos_fault), `advantages` normalises the advantages over the whole batch instead of the group
(rl_step_parity_advantages_fault), `pads` attends the prompts' left pads (rl_step_parity_pads_fault); each must fail
naming that tensor. A fault run stops at its first failure.

Usage: python tests/oracle/rl_step_parity.py BUILD/streambp
"""
# ctest-fault: rl_step_parity_fault STREAMBP_RL_FAULT=1e-6 FAIL: .*step [0-9]+ gradient .*normwise
# ctest-fault: rl_step_parity_eos_fault STREAMBP_RL_TRL_BUG=eos FAIL: .*completion_mask differs
# ctest-fault: rl_step_parity_advantages_fault STREAMBP_RL_TRL_BUG=advantages FAIL: .*advantages differ
# ctest-fault: rl_step_parity_pads_fault STREAMBP_RL_TRL_BUG=pads FAIL: .*token_logps differ
# ctest-cost: 40
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

try:
    import torch
    import transformers
    import trl
    from safetensors.torch import load_file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "verify" / "conform"))
    from streambp_conform import rl, trl_grpo
    import rl_trainer_bugs
except ImportError as e:  # an oracle that cannot run fails: a CI without its oracles is not green
    print(f"FAIL: missing oracle dependency: {e} (make installs transformers and trl into the venv)")
    sys.exit(1)

from hf_parity import patch_rms_norms  # noqa: E402
from parity_metrics import normwise_error  # noqa: E402

GRAD_RTOL, ADV_RTOL = 1e-10, 1e-12
EOS, PAD, UNK = 1, 0, 2
FAILURES = []

# Two prompts of uneven lengths, two completions each (TRL's row order: a prompt's completions are consecutive):
# one stops at an EOS and generates on (TRL must mask the tail), one is truncated at max_completion_length, one is a
# lone EOS. Rewards of two functions, exact in fp32.
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12]]
COMPLETIONS = [[7, 9, EOS, 4, 4], [11, 12, 13, 14, 15], [EOS, 30, 31], [21, EOS]]
REWARDS = [[1.0, 0.5], [0.0, 1.0], [0.25, 0.0], [2.0, 0.5]]
MAX_COMPLETION = 5

# The settings of each case, in GRPOConfig's names (reward_weights, learning_rate: SGD's). Each reaches a different
# part of the step: accumulation of two micro-batches in one optimizer step; two optimizer steps of one generation
# batch (old log-probs from generation time); two iterations over it; masked truncated completions.
CASES = [
    dict(loss_type="dapo", scale_rewards="group", beta=0.04, temperature=0.9, per_device_train_batch_size=2,
         gradient_accumulation_steps=2, reward_weights=[1.0, 0.5]),
    dict(loss_type="grpo", scale_rewards="batch", beta=0.0, per_device_train_batch_size=2,
         gradient_accumulation_steps=1, steps_per_generation=2, learning_rate=0.02, reward_weights=[1.0, 0.5]),
    dict(loss_type="bnpo", scale_rewards="none", beta=0.04, importance_sampling_level="sequence", epsilon_high=0.28,
         per_device_train_batch_size=4, gradient_accumulation_steps=1, num_iterations=2, learning_rate=0.02,
         reward_weights=[0.5, 2.0]),
    dict(loss_type="dr_grpo", scale_rewards=True, beta=0.0, mask_truncated_completions=True,
         per_device_train_batch_size=2, gradient_accumulation_steps=2, reward_weights=[1.0, 1.0]),
    # TRL's default KL: times the importance ratio (use_bias_correction_kl), over two optimizer steps
    dict(loss_type="dapo", scale_rewards="group", beta=0.04, use_bias_correction_kl=True, per_device_train_batch_size=2,
         gradient_accumulation_steps=1, steps_per_generation=2, learning_rate=0.02, reward_weights=[1.0, 0.5]),
]


def fail(msg):
    FAILURES.append(msg)
    print("FAIL:", msg)
    if os.environ.get("STREAMBP_RL_FAULT") or os.environ.get("STREAMBP_RL_TRL_BUG"):
        sys.exit(1)  # a negative control has shown what it must


def base_case(settings):
    """The case file's content before TRL runs: its settings in GRPOConfig's names, plus what the oracle needs."""
    s = dict({"use_bias_correction_kl": False}, **settings, num_generations=2, max_completion_length=MAX_COMPLETION,
             eos_token_id=EOS, pad_token_id=PAD)
    return rl.RlCase(PROMPTS, COMPLETIONS, REWARDS, s)


def run_trl(model_dir, case):
    """TRL's GRPOTrainer.train() on the case through the package's driver (streambp_conform.trl_grpo), TRL's own
    shuffle recorded; STREAMBP_RL_TRL_BUG plants a trainer bug (tests/support/rl_trainer_bugs.py)."""
    bug = os.environ.get("STREAMBP_RL_TRL_BUG")
    hooks = rl_trainer_bugs.hooks(bug, EOS) if bug else None
    return trl_grpo.train(case, model_dir, layout="trl", hooks=hooks), trl_grpo.optimizer_steps(case)


def compare(i, settings, record, steps, ours):
    what = f"case {i} ({settings['loss_type']}, scale_rewards={settings['scale_rewards']})"
    failures_before = len(FAILURES)
    trl_rows = torch.tensor(record.rows)
    adv_ours = ours["advantages"][trl_rows]
    err = ((record.advantages - adv_ours).abs().max() / adv_ours.abs().max()).item()
    if not err <= ADV_RTOL:
        fail(f"{what}: advantages differ from TRL's by {err:.3e}")
    mask = record.completion_mask
    mask_ours = ours["completion_mask"][trl_rows][:, :mask.shape[1]]
    if not torch.equal(mask.to(mask_ours.dtype), mask_ours):
        fail(f"{what}: completion_mask differs from TRL's")
    # TRL's per-token log-probs of the generation batch at generation time, where the loss scores
    lp, lp_ours = record.token_logps, ours["token_logps"][trl_rows][:, :record.token_logps.shape[1]]
    where = mask_ours[:, :lp.shape[1]].bool()
    lp_err = ((lp - lp_ours)[where].abs().max() / lp_ours[where].abs().max()).item()
    if not lp_err <= ADV_RTOL:
        fail(f"{what}: token_logps differ from TRL's by {lp_err:.3e}")
    if len(record.gradients) != steps:
        fail(f"{what}: TRL took {len(record.gradients)} optimizer steps, the case has {steps}")
    eps = os.environ.get("STREAMBP_RL_FAULT")
    if eps and record.gradients:  # the negative control: one step's gradients off by 1 + eps
        record.gradients[-1] = {n: g * (1 + float(eps)) for n, g in record.gradients[-1].items()}
    worst, worst_at = 0.0, "-"
    for k, grads in enumerate(record.gradients, start=1):
        for name, g in grads.items():
            key = f"step{k}/{name}"
            e = normwise_error(g, ours[key]) if key in ours else float("inf")
            if not e <= GRAD_RTOL:
                fail(f"{what}: step {k} gradient {name}: normwise {e:.3e} against the oracle")
            if not e <= worst:
                worst, worst_at = e, f"step {k} {name}"
    print(f"{'ok' if len(FAILURES) == failures_before else 'FAIL'}: {what}: {steps} optimizer step(s), advantages rel "
          f"{err:.1e}, token log-probs rel {lp_err:.1e}, largest "
          f"gradient error {worst:.2e} ({worst_at})")


def main():
    binary = sys.argv[1]
    patch_rms_norms()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    print(f"transformers {transformers.__version__}, trl {trl.__version__}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        p = subprocess.run([binary, "run", "--preset", "tiny", "--method", "standard", "--seq", "8", "--seed", "5",
                            "--dtype", "fp64", "--save-model", model_dir], capture_output=True, text=True)
        if p.returncode != 0:
            print(f"FAIL: streambp run: exit {p.returncode}\n{p.stdout}{p.stderr}")
            return 1
        for i, settings in enumerate(CASES):
            case = base_case(settings)
            record, steps = run_trl(model_dir, case)
            case_file, out = work / f"case{i}.json", work / f"case{i}.safetensors"
            case_file.write_text(json.dumps(rl.with_micro_batches(case, record).to_json()))
            p = subprocess.run([binary, "rl-step", "--load", model_dir, "--case", case_file, "--out", out],
                               capture_output=True, text=True)
            if p.returncode != 0:
                fail(f"case {i}: streambp rl-step: exit {p.returncode}\n{p.stdout}{p.stderr}")
                continue
            compare(i, settings, record, steps, load_file(str(out)))
    print(f"{'FAILED' if FAILURES else 'passed'}: {len(FAILURES)} failure(s)")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
