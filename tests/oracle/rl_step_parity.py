"""Whole GRPO steps: TRL's own GRPOTrainer.train() (the pinned trl, 1.16.0) against our RL step oracle
(`streambp rl-step`, verify/rl_step_oracle.h, docs/rl-steps.md), in fp64, on hand-made tiny cases.

The adapter's side is the package's (verify/conform/streambp_conform/rl.py); this script is its complete example on
TRL. TRL runs its own code from the generation batch to the optimizer: left-padding, masking after the first EOS, the
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
must equal ours (normwise <= 1e-10 per tensor), and TRL's advantages, completion mask and per-token log-probs (of its
first micro-batch, before any update) ours.

Negative controls (CTest): STREAMBP_RL_FAULT scales the gradient TRL handed the optimizer at its last step, and the
script must fail naming that step and a tensor (rl_step_parity_fault). STREAMBP_RL_TRL_BUG plants a bug in the trainer,
in what TRL's _generate_and_score_completions hands its loss: `eos` drops each row's EOS from the completion mask
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
    from datasets import Dataset
    from safetensors.torch import load_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from trl import GRPOConfig, GRPOTrainer
    import trl.trainer.grpo_trainer as grpo_module
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "verify" / "conform"))
    from streambp_conform import rl
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


def planted_bug(out):
    """STREAMBP_RL_TRL_BUG: a known trainer bug planted in TRL's generation batch (see the module docstring)."""
    bug = os.environ.get("STREAMBP_RL_TRL_BUG")
    if bug == "eos":
        mask = out["completion_mask"]
        last = mask.sum(1) - 1  # the kept completion's last token: its EOS, unless truncated
        ends_with_eos = out["completion_ids"].gather(1, last.clamp(min=0).unsqueeze(1)).squeeze(1) == EOS
        rows = (ends_with_eos & (last >= 0)).nonzero().flatten()
        mask[rows, last[rows]] = 0
    elif bug == "advantages":
        a = out["advantages"]  # TRL's group-normalised advantages, normalised again over the whole batch
        out["advantages"] = (a - a.mean()) / (a.std() + 1e-4)
    elif bug == "pads":
        out["prompt_mask"] = torch.ones_like(out["prompt_mask"])  # the left pads attended
    elif bug:
        raise SystemExit(f"unknown STREAMBP_RL_TRL_BUG={bug!r} (eos, advantages, pads)")
    return out


def tokenizer(vocab_size):
    """A word-level tokenizer whose token i is the word "w{i}" (the special ones have names that are no prefix of a
    word: TRL's tokenizer matches special tokens inside words): prompts are written as text and read back exactly."""
    vocab = {word(i): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=word(UNK)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=word(PAD), eos_token=word(EOS),
                                                unk_token=word(UNK))


def word(i):
    return {PAD: "<pad>", EOS: "<eos>", UNK: "<unk>"}.get(i, f"w{i}")


def text(ids):
    return " ".join(word(i) for i in ids)


def base_case(settings):
    """The case file's content before TRL runs: its settings in GRPOConfig's names, plus what the oracle needs."""
    s = dict({"use_bias_correction_kl": False}, **settings, num_generations=2, max_completion_length=MAX_COMPLETION,
             eos_token_id=EOS, pad_token_id=PAD)
    return rl.RlCase(PROMPTS, COMPLETIONS, REWARDS, s)


def run_trl(model_dir, case, work):
    """TRL's GRPOTrainer.train() on the case, through streambp_conform.rl (the adapter's side of docs/rl-steps.md)."""
    s = case.settings
    record = rl.Record()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="sdpa")
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = EOS, PAD
    model.generate = rl.generate_stand_in(case, record)
    spg = s.get("steps_per_generation") or s["gradient_accumulation_steps"]
    steps = spg * s.get("num_iterations", 1) // s["gradient_accumulation_steps"]
    oracle_only = ("learning_rate", "eos_token_id", "pad_token_id")
    config = GRPOConfig(output_dir=str(work / "trl"), report_to=[], use_cpu=True, save_strategy="no",
                        logging_steps=1000, max_steps=steps, max_grad_norm=0.0, seed=3,
                        **{k: v for k, v in s.items() if k not in oracle_only})
    optimizer = torch.optim.SGD(model.parameters(), lr=s.get("learning_rate", 0.0))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    dataset = Dataset.from_dict({"prompt": [text(p) for p in PROMPTS]})
    trainer = GRPOTrainer(model=model, args=config, train_dataset=dataset,
                          processing_class=tokenizer(model.config.vocab_size),
                          reward_funcs=rl.reward_functions(case, text), optimizers=(optimizer, schedule),
                          callbacks=[rl.optimizer_gradients(model, record)])
    model.forward = rl.trl_fp64_head(model, config.temperature)  # after TRL installed its fused head
    if trainer.ref_model is not None:
        trainer.ref_model.forward = rl.trl_fp64_head(trainer.ref_model, config.temperature)

    score = trainer._generate_and_score_completions

    def recording_score(inputs):  # TRL's advantages and completion mask, for the comparison of those stages
        out = planted_bug(score(inputs))
        record.advantages, record.mask = out["advantages"].detach().clone(), out["completion_mask"].detach().clone()
        return out
    trainer._generate_and_score_completions = recording_score
    logps = trainer._get_per_token_logps_and_entropies
    record.first_logps = None

    def recording_logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        out = logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if kwargs.get("compute_entropy") and record.first_logps is None:  # the loss's pass of the first micro-step
            record.first_logps = (out[0].detach().clone(), attention_mask[:, -logits_to_keep:].clone())
        return out
    trainer._get_per_token_logps_and_entropies = recording_logps
    torch.set_default_dtype(torch.float64)
    try:
        with rl.recorded_shuffle(grpo_module, record):
            trainer.train()
    finally:
        torch.set_default_dtype(torch.float32)
    return record, steps


def compare(i, settings, record, steps, ours):
    what = f"case {i} ({settings['loss_type']}, scale_rewards={settings['scale_rewards']})"
    failures_before = len(FAILURES)
    trl_rows = torch.tensor(record.rows)
    adv_ours = ours["advantages"][trl_rows]
    err = ((record.advantages - adv_ours).abs().max() / adv_ours.abs().max()).item()
    if not err <= ADV_RTOL:
        fail(f"{what}: advantages differ from TRL's by {err:.3e}")
    mask_ours = ours["completion_mask"][trl_rows][:, :record.mask.shape[1]]
    if not torch.equal(record.mask.to(mask_ours.dtype), mask_ours):
        fail(f"{what}: completion_mask differs from TRL's")
    lp, scored = record.first_logps  # TRL's per-token log-probs of its first micro-batch, before any update
    first_rows = torch.tensor([record.rows[j] for j in record.permutation[:lp.shape[0]]])
    lp_ours = ours["token_logps"][first_rows][:, :lp.shape[1]]
    where = scored.bool()
    lp_err = ((lp - lp_ours)[where].abs().max() / lp_ours[where].abs().max()).item()
    if not lp_err <= ADV_RTOL:
        fail(f"{what}: token_logps differ from TRL's by {lp_err:.3e} (its first micro-batch)")
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
            record, steps = run_trl(model_dir, case, work / f"case{i}")
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
