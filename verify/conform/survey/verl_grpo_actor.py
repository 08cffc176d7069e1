#!/usr/bin/env python3
"""verl 0.9.1's GRPO actor update under streambp-conform/1: whole RL steps (`streambp conform --cases rl-verl`,
docs/rl-steps.md), in fp64, on one CPU process. Usage: verl_grpo_actor.py CASE_DIR

verl 0.9.1 has no dp_actor.py any more: its PPO trainer (trainer/ppo/ray_trainer.py) hands the actor's update to the
engine worker (workers/engine_workers.py TrainingWorker.train_mini_batch -> train_batch -> the FSDP engine's
train_batch: forward_backward_batch over micro-batches, optimizer_step), with workers/utils/losses.py ppo_loss as its
loss. This adapter runs those, as the trainer calls them, on the case's generation batch:
- the batch as the trainer holds it after a rollout: prompts left-padded, responses right-padded, the response mask
  from verl's get_response_mask (the first EOS kept, everything after it masked), position ids from the attention
  mask; converted by verl's left_right_2_no_padding (its remove-padding form, nested tensors);
- the reward of a response at its last kept token (verl's reward managers' layout: one score, Σ_f w_f r_f of the
  case's reward columns; verl has one reward function per data source, so the weighted sum is the user's);
- its GRPO advantage estimator (get_adv_estimator_fn("grpo"): compute_grpo_outcome_advantage with
  norm_adv_by_std_in_grpo, its std + 1e-6);
- old and reference log-probs by the engine's forward-only pass (forward_backward_batch, forward_only) on the weights
  of generation time;
- the update: tu.make_iterator over mini-batches of ppo_mini_batch_size x n rows (no shuffle: the case's
  micro_batches give the order), ppo_epochs passes, each mini-batch one engine.train_batch (micro-batches of
  ppo_micro_batch_size_per_gpu rows, use_remove_padding, its batch_num_tokens over the mini-batch), ppo_loss with
  policy_loss.loss_mode "vanilla", loss_agg_mode, clip_ratio_low/high, use_kl_loss with kl_loss_type low_var_kl
  (TRL's k3), the global batch info the trainer sets (global_batch_size = ppo_mini_batch_size x n).

What is replaced, and nothing else: verl's device platform (it has none for the CPU: a CUDA one whose device is
the CPU), FSDP (the engine object holds the plain HF model: one process, dp = 1; verl
registers its FSDP engine for CUDA and NPU only), the CUDA flash-attention varlen kernel under verl's attention patch
(by exact causal attention per packed sequence: verl_ulysses.varlen_causal_attention), the optimizer (plain SGD at the
case's learning_rate; clip_grad infinite, so its clip multiplies by 1), and the dtype of the rewards, old and
reference log-probs: verl's trainer makes them fp32 (its reward managers' reward tensor; `.float()` on the log-probs
in ray_trainer.py _compute_old_log_prob / _compute_ref_log_prob), which would make every fp64 row an fp32 one; here
they stay fp64.

The case must declare verl's normaliser (conform's rl-verl set: settings loss_agg_mode, advantage_epsilon 1e-6).
A setting verl's actor has no counterpart for is NotExpressible, naming it: scale_rewards batch (its GRPO estimator
normalises per group or not at all), sequence importance (the vanilla loss's ratio is per token), bnpo over several
micro-batches (no per-micro-batch token count), mask_truncated_completions, TRL's bias-corrected KL once the policy
has moved (verl's KL estimators have no importance-ratio factor), and a mini-batch that is not whole prompts.
VERL_GRPO_FAULT=no-std: the negative control (norm_adv_by_std_in_grpo flipped: the row fails at advantages).
"""
import contextlib
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))
import protocol  # noqa: E402

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def verl_settings(s):
    """The case's settings as verl's actor and GRPO estimator configuration, or NotExpressible naming what is missing."""
    nx = protocol.NotExpressible
    mode = s.get("loss_agg_mode")
    if mode not in MODES:
        raise nx(f"loss_type {s.get('loss_type')!r} with no loss_agg_mode declared: verl's agg_loss normalises over the "
                 "mini-batch, it has no per-micro-batch token count (conform's rl-verl set declares verl's normaliser "
                 "where it has one)")
    if s.get("advantage_epsilon") != 1e-6:
        raise nx(f"advantage_epsilon {s.get('advantage_epsilon')!r}: verl's GRPO estimator adds 1e-6 to the std")
    if s.get("scale_rewards") not in ("group", "none"):
        raise nx(f"scale_rewards {s.get('scale_rewards')!r}: verl's GRPO advantages are normalised per group "
                 "(norm_adv_by_std_in_grpo true) or not at all (false)")
    if s.get("importance_sampling_level", "token") != "token":
        raise nx("importance_sampling_level sequence: the vanilla policy loss's ratio is per token (GSPO is another "
                 "loss_mode with its own objective)")
    if s.get("mask_truncated_completions"):
        raise nx("mask_truncated_completions: verl's actor has no option that masks truncated responses")
    G, B, GA = s["num_generations"], s["per_device_train_batch_size"], s["gradient_accumulation_steps"]
    spg, iters = s.get("steps_per_generation") or GA, s.get("num_iterations", 1)
    optimizer_steps = spg * iters // GA
    if s.get("beta", 0.0) > 0 and s.get("use_bias_correction_kl") and optimizer_steps > 1:
        raise nx("use_bias_correction_kl with beta > 0 after an update: verl's kl_loss_type estimators (k1, k2, k3, "
                 "abs) have no importance-ratio factor")
    if (B * GA) % G:
        raise nx(f"a mini-batch of {B * GA} rows: verl's ppo_mini_batch_size counts prompts of n = {G} responses")
    return {"mode": mode, "norm_by_std": s["scale_rewards"] == "group", "mini_rows": B * GA, "micro_rows": B,
            "epochs": iters, "optimizer_steps": optimizer_steps, "n": G}


@contextlib.contextmanager
def single_process_group():
    """A Gloo group of one process: the engine's all-reduce of batch_num_tokens runs over dp = 1."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory(prefix="streambp-verl-") as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def cpu_platform():
    """verl 0.9.1 registers CUDA and NPU platforms only and falls back to CUDA (plugin/platform/platform_manager.py):
    a platform whose device is the CPU, for the engine's `.to(get_device_id())` and its device-name checks."""
    import torch
    from verl.plugin.platform.platform_cuda import PlatformCUDA
    from verl.plugin.platform.platform_manager import set_platform

    class PlatformCPU(PlatformCUDA):
        device_name = "cpu"
        device_module = torch.cpu

        def current_device(self):
            return "cpu"

        def is_available(self):
            return True
    set_platform(PlatformCPU())


def engine_for(model, clip_grad=float("inf")):
    """verl's FSDPEngineWithLMHead around the plain model, with the state its train and forward paths read (dp = 1,
    no Ulysses, no static packing pad, no autocast: fp64 stays fp64)."""
    import types

    import torch
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    e = object.__new__(FSDPEngineWithLMHead)
    e.module = model
    e.use_ulysses_sp, e.ulysses_sequence_parallel_size = False, 1
    e.pad_to_length, e._autocast_dtype, e._qat_enabled, e.scaler = False, torch.float32, False, None
    e.engine_config = types.SimpleNamespace(use_no_sync_for_gradient_accumulation=True, entropy_checkpointing=False,
                                            entropy_from_logits_with_chunking=False)
    e.optimizer_config = types.SimpleNamespace(clip_grad=clip_grad)
    e.get_data_parallel_group = lambda: None
    e.get_data_parallel_size = lambda: 1
    e.get_data_parallel_rank = lambda: 0
    e.is_mp_src_rank_with_outputs = lambda: True
    return e


def rollout_batch(case, rows):
    """The generation batch as verl's trainer holds it after a rollout (a TensorDict in left-right padding), in the
    order `rows` (case rows), with its uid per prompt."""
    import numpy as np
    import torch
    from tensordict import TensorDict
    from verl.utils.torch_functional import get_response_mask

    rl, s = case.rl, case.rl.settings
    C, pad, eos = s["max_completion_length"], rl.pad, rl.eos
    prompts = [rl.prompts[r // rl.group] for r in rows]
    P = max(len(p) for p in prompts)
    prompt_ids = torch.tensor([[pad] * (P - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    responses = torch.tensor([rl.completions[r] + [pad] * (C - len(rl.completions[r])) for r in rows])
    response_mask = get_response_mask(responses, eos_token=eos, dtype=torch.int64)
    length = torch.tensor([len(rl.completions[r]) for r in rows])
    response_mask = response_mask * (torch.arange(C)[None, :] < length[:, None])  # the generation's own tokens
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # verl's compute_position_id_with_mask
    td = TensorDict({"prompts": prompt_ids, "responses": responses, "input_ids": torch.cat([prompt_ids, responses], 1),
                     "attention_mask": attention_mask, "response_mask": response_mask, "position_ids": position_ids},
                    batch_size=[len(rows)])
    uid = np.array([f"prompt-{r // rl.group}" for r in rows], dtype=object)
    return td, uid


def scores_at_last_token(case, rows, response_mask):
    """verl's reward layout: each response's score at its last kept token, zeros elsewhere (fp64; the case's
    weighted reward columns as one score)."""
    import torch

    s = case.rl.settings
    weights = s.get("reward_weights") or [1.0] * len(case.rl.rewards[0])
    rewards = torch.zeros(response_mask.shape, dtype=torch.float64)
    last = response_mask.sum(-1) - 1
    for i, r in enumerate(rows):
        rewards[i, last[i]] = sum(w * x for w, x in zip(weights, case.rl.rewards[r]))
    return rewards


def step(case):
    import torch
    import transformers

    protocol.quiet_hf()
    protocol.fp64_exact()
    v = verl_settings(case.rl.settings)
    s = case.rl.settings
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import flash_attention_mask

    import verl.models.transformers.monkey_patch as verl_patch
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding
    from verl_ulysses import varlen_causal_attention

    cpu_platform()
    model = transformers.AutoModelForCausalLM.from_pretrained(case.model_dir, dtype=torch.float64)
    AttentionInterface.register("verl_cpu_varlen", flash_attention_forward)
    AttentionMaskInterface.register("verl_cpu_varlen", flash_attention_mask)
    model.set_attn_implementation("verl_cpu_varlen")
    verl_patch.is_trl_available = lambda: False  # the venv's trl has no PPO value head for it to patch
    verl_patch.apply_monkey_patch(model, ulysses_sp_size=1, use_remove_padding=True)
    verl_patch._flash_attention_forward = varlen_causal_attention

    # The rows in the case's micro-batch order: verl's iterator then cuts them into the case's mini- and micro-batches.
    order = [r for micro in case.rl.micro_batches for r in micro] or list(range(len(case.rl.completions)))
    td, uid = rollout_batch(case, order)
    rewards = scores_at_last_token(case, order, td["response_mask"])
    # VERL_GRPO_FAULT=no-std (the negative control): verl's own estimator with norm_adv_by_std_in_grpo flipped, the
    # Dr. GRPO switch set against the case; the row must fail naming advantages
    norm_by_std = v["norm_by_std"] != (os.environ.get("VERL_GRPO_FAULT") == "no-std")
    advantages, _ = get_adv_estimator_fn("grpo")(token_level_rewards=rewards, response_mask=td["response_mask"],
                                                 index=uid, norm_adv_by_std_in_grpo=norm_by_std)
    temperature = s.get("temperature", 1.0)
    beta = s.get("beta", 0.0)
    engine = engine_for(model)
    engine.optimizer = torch.optim.SGD(model.parameters(), lr=s.get("learning_rate", 0.0))
    grads = []
    step_fn = engine.optimizer.step

    def recording_step(*args, **kwargs):  # the gradient the optimizer receives, after verl's clip (x 1)
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        return step_fn(*args, **kwargs)
    engine.optimizer.step = recording_step
    micro_keys = dict(use_remove_padding=True, use_dynamic_bsz=False, micro_batch_size_per_gpu=v["micro_rows"],
                      use_fused_kernels=False, temperature=temperature)

    with single_process_group():
        def log_probs(batch):  # the engine's forward-only pass (compute_log_prob / compute_ref_log_prob's)
            data = left_right_2_no_padding(batch.clone())
            tu.assign_non_tensor(data, calculate_entropy=False, compute_loss=False, **micro_keys)
            with torch.no_grad():
                out = engine.forward_backward_batch(data, loss_function=None, forward_only=True)
            return no_padding_2_padding(tu.get(out["model_output"], "log_probs")
                                        if not isinstance(out["model_output"], dict)
                                        else out["model_output"]["log_probs"], data)

        old = log_probs(td).to(torch.float64)
        td["old_log_probs"] = old
        td["advantages"] = advantages
        if beta > 0:
            td["ref_log_prob"] = old.clone()  # the reference is the policy at generation time
        config = FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=v["mini_rows"] // v["n"],
                                 ppo_micro_batch_size_per_gpu=v["micro_rows"], rollout_n=v["n"],
                                 use_dynamic_bsz=False, ppo_epochs=v["epochs"], shuffle=False,
                                 loss_agg_mode=v["mode"], clip_ratio=s.get("epsilon", 0.2),
                                 clip_ratio_low=s.get("epsilon", 0.2),
                                 clip_ratio_high=s.get("epsilon_high", s.get("epsilon", 0.2)),
                                 loss_scale_factor=(s["max_completion_length"]
                                                    if v["mode"] == "seq-mean-token-sum-norm" else None),
                                 use_kl_loss=beta > 0, kl_loss_coef=beta, kl_loss_type="low_var_kl",
                                 entropy_coeff=0.0, use_remove_padding=True)
        data = left_right_2_no_padding(td)
        tu.assign_non_tensor(data, calculate_entropy=False, global_batch_size=v["mini_rows"], compute_loss=True)

        def loss(model_output, data, dp_group=None):
            return ppo_loss(config, model_output, data, dp_group)
        # TrainingWorker.train_mini_batch's loop: its iterator over mini-batches and epochs, train_batch each
        for mini in tu.make_iterator(data, mini_batch_size=v["mini_rows"], epochs=v["epochs"], seed=42,
                                     dataloader_kwargs={"shuffle": False}):
            for key, val in micro_keys.items():
                if key not in mini.keys():
                    tu.assign_non_tensor(mini, **{key: val})
            engine.train_batch(mini, loss_function=loss)
    if len(grads) != v["optimizer_steps"]:
        raise RuntimeError(f"verl took {len(grads)} optimizer steps, the case has {v['optimizer_steps']}")

    to_case = torch.tensor([order.index(r) for r in range(len(order))])
    out = {f"step{k}/{n}": g for k, step_grads in enumerate(grads, start=1) for n, g in step_grads.items()}
    out["advantages"] = advantages[:, 0][to_case]  # verl's per-token advantages: the row's, on every kept token
    mask = td["response_mask"]
    out["completion_mask"] = mask.to(torch.float64)[to_case]
    out["token_logps"] = (old * mask)[to_case]
    return 0.0, out


if __name__ == "__main__":
    sys.exit(protocol.run(step, rl_steps=True, usage="Usage: verl_grpo_actor.py CASE_DIR"))
