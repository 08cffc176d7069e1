"""TRL's own GRPO and DPO losses (the pinned `trl` package, Makefile), driven on a Hugging Face model and a batch in
our file layout (docs/objectives.md), for tests/objective_parity.py.

TRL's trainers compute their losses in methods (GRPOTrainer._compute_loss, DPOTrainer._compute_loss) whose __init__
needs datasets, tokenizers and an output directory. We build the trainer object without __init__ and set only the
attributes those methods read, from TRL's own config class (so TRL's defaults apply to everything we do not set),
mirroring what __init__ assigns. The loss arithmetic (ratios, clipping, KL, normalisation; DPO's sums, margins and
losses) is then TRL's code, as released.

The per-token log-probs come from one of two heads, both TRL's own code:
  head="fp64":  TRL's `selective_log_softmax_and_entropy` on the model's fp64 logits (TRL's unfused log-prob path),
                behind the interface of TRL's fused head. Exact in fp64: this is the head the 1e-12 / 1e-10 gates use.
  head="fused": TRL's `add_fused_lm_head`, the head the released trainers install. It computes in fp32 whatever the
                model's dtype (trl/kernels/chunked_logprob.py casts each logit tile with .float() and keeps fp32
                accumulators), so it can only agree to fp32 rounding; it checks TRL's label shift, masking and
                temperature placement end to end against ours, at an fp32 tolerance.
"""
import os
from collections import defaultdict

import torch
import trl
from accelerate import Accelerator
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer
from trl.trainer.utils import FusedCausalLMOutput, add_fused_lm_head, selective_log_softmax_and_entropy

VERSION = trl.__version__


class Fp64Head(torch.nn.Module):
    """TRL's fused-head call contract (`model(..., labels=labels, fused_lm_head=True)` returns per-token fields of
    shape [B, T-1], zero where the shifted label is -100), computed from the full fp64 logits with TRL's
    selective_log_softmax_and_entropy instead of TRL's fp32 tiles."""

    def __init__(self, model, temperature=1.0):
        super().__init__()
        self.model, self.temperature = model, temperature

    def forward(self, input_ids, attention_mask, labels, fused_lm_head, use_cache=False):
        assert fused_lm_head
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache).logits[:, :-1]
        labels = labels[:, 1:]  # position t predicts token t + 1: [B, T-1]
        mask = labels != -100
        log_probs, entropy = selective_log_softmax_and_entropy(
            logits, labels.clamp(min=0), entropy_requires_grad=False, temperature=self.temperature, row_mask=mask)
        with torch.no_grad():  # metrics only (DPO logs them); not part of any loss
            scaled = logits / self.temperature
            mean_logits = scaled.mean(-1).masked_fill(~mask, 0)
            is_top1 = (scaled.argmax(-1) == labels) & mask
        return FusedCausalLMOutput(log_probs=log_probs, entropy=entropy, mean_logits=mean_logits, is_top1=is_top1,
                                   label_mask=mask)


def head_model(model, head, temperature):
    if head == "fp64":
        return Fp64Head(model, temperature)
    add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    return model


def trl_fault(loss):
    """Negative control of the TRL comparison (CTest objective_parity_trl_fault): with STREAMBP_TRL_FAULT=EPS, TRL's
    loss (and so every TRL gradient) is scaled by 1 + EPS, and the script must fail its TRL gate."""
    eps = os.environ.get("STREAMBP_TRL_FAULT")
    return loss * (1 + float(eps)) if eps else loss


def _config(cls, **kw):
    """TRL's config with its defaults. Creating it resets accelerate's global state, so the trainer's Accelerator
    (one CPU process: gather and reduce are identities, num_processes = 1) is made after it."""
    return cls(output_dir=os.devnull, report_to=[], use_cpu=True, **kw)


def grpo_loss(model, b, o, head="fp64"):
    """GRPOTrainer._compute_loss on our GRPO batch (input_ids, attention_mask, completion_mask [B, T]; advantages [B];
    old_logps / ref_logps [B, T] with entry t = log-prob of token t).

    TRL's layout is prompt_ids + completion_ids, with per-token tensors [B, C] over the completion part, and TRL
    attends with cat(prompt_mask, completion_mask). Our rows' prompts may differ in length, so we split at the first
    column holding any completion token (p), give TRL our attention mask over the completion part as its
    completion_mask (so TRL's forward is ours) and our completion mask as TRL's `tool_mask` (TRL's own way of
    dropping tokens inside the completion part from the loss: its loss mask is completion_mask * tool_mask)."""
    cm = b["completion_mask"]
    p = int(cm.any(0).nonzero()[0])
    assert p >= 1 and not cm[:, :p].any() and bool((cm <= b["attention_mask"]).all())
    args = _config(GRPOConfig, beta=o.get("beta", 0.0), loss_type=o.get("loss_type", "dapo"),
                   importance_sampling_level=o.get("importance", "token"), temperature=o.get("temperature", 1.0),
                   epsilon=o.get("epsilon_low", 0.2), epsilon_high=o.get("epsilon_high"),
                   max_completion_length=o.get("max_completion_length", 256),
                   # The pinned TRL multiplies the k3 KL by the importance ratio by default (DeepSeek-V3.2's bias
                   # correction): our objective's kl=k3_ratio; its default is the plain k3 KL, TRL's switch off.
                   use_bias_correction_kl=o.get("kl", "k3") == "k3_ratio")
    t = object.__new__(GRPOTrainer)
    # What GRPOTrainer.__init__ sets from `args` and _compute_loss / _get_per_token_logps_and_entropies read:
    t.args, t.accelerator, t.model = args, Accelerator(cpu=True), model
    t.beta, t.loss_type, t.importance_sampling_level = args.beta, args.loss_type, args.importance_sampling_level
    t.epsilon_low = args.epsilon
    t.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    t.max_completion_length, t.temperature = args.max_completion_length, args.temperature
    t.top_entropy_quantile, t.off_policy_mask_threshold = args.top_entropy_quantile, args.off_policy_mask_threshold
    t.use_vllm, t.vllm_importance_sampling_correction = args.use_vllm, args.vllm_importance_sampling_correction
    t.entropy_coef, t.use_adaptive_entropy = args.entropy_coef, args.use_adaptive_entropy
    t._entropy_bonus_enabled = t.entropy_coef != 0.0 or t.use_adaptive_entropy
    t.aux_loss_enabled = False  # dense Qwen3: no router
    t.current_gradient_accumulation_steps = 1  # one micro-batch per step, as our step
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}  # TRL's metrics, dropped
    inputs = {
        "prompt_ids": b["input_ids"][:, :p], "prompt_mask": b["attention_mask"][:, :p],
        "completion_ids": b["input_ids"][:, p:], "completion_mask": b["attention_mask"][:, p:],
        "tool_mask": cm[:, p:],
        "advantages": b["advantages"],
        # dapo's divisor: the generation batch's completion tokens (one process, one micro-batch per generation)
        "num_items_in_batch": cm.sum().to(torch.float64),
    }
    if "old_logps" in b:  # absent: TRL uses the current log-probs, detached (one update per generation)
        inputs["old_per_token_logps"] = b["old_logps"][:, p:]
    if t.beta != 0.0:
        inputs["ref_per_token_logps"] = b["ref_logps"][:, p:]
    return trl_fault(t._compute_loss(head_model(model, head, args.temperature), inputs))


def dpo_loss(model, b, o, head="fp64"):
    """DPOTrainer._compute_loss on our DPO batch (rows 0..P-1 chosen, P..2P-1 rejected, as TRL's; ref_logps [2P]
    summed reference log-probs, passed as TRL's precomputed reference).

    The pinned TRL (as 0.29 and 1.x checked) no longer applies label_smoothing in its "sigmoid" loss; the
    conservative loss we implement, -(1-ls)·logσ(z) - ls·logσ(-z), is driven through TRL as the exact combination
    2(1-ls)·sigmoid - (1-2ls)·robust of TRL's own losses (TRL's `loss_weights`; robust with the same ls is
    [-(1-ls)·logσ(z) + ls·logσ(-z)]/(1-2ls)), which is what TRL would compute for that combination."""
    beta, ls = o.get("beta", 0.1), o.get("label_smoothing", 0.0)
    if ls == 0.0:
        loss_type, loss_weights = ["sigmoid"], None
    else:
        loss_type, loss_weights = ["sigmoid", "robust"], [2 * (1 - ls), -(1 - 2 * ls)]
    args = _config(DPOConfig, beta=beta, loss_type=loss_type, loss_weights=loss_weights, label_smoothing=ls,
                   precompute_ref_log_probs=True)
    t = object.__new__(DPOTrainer)
    # What DPOTrainer.__init__ sets from `args` and _compute_loss reads:
    t.args, t.accelerator, t.model = args, Accelerator(cpu=True), model
    t.beta, t.precompute_ref_logps = args.beta, args.precompute_ref_log_probs
    t.loss_types = args.loss_type
    t.loss_weights = args.loss_weights or [1.0] * len(t.loss_types)
    t.ld_alpha, t.f_divergence_type = args.ld_alpha, args.f_divergence_type
    t.f_alpha_divergence_coef = args.f_alpha_divergence_coef
    t.label_smoothing, t.use_weighting = args.label_smoothing, args.use_weighting
    t.aux_loss_enabled, t._tp_size, t._total_train_tokens = False, 1, 0
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}  # TRL's metrics, dropped
    P = b["ref_logps"].size(0) // 2
    inputs = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"],
              "completion_mask": b["completion_mask"],
              "ref_chosen_logps": b["ref_logps"][:P], "ref_rejected_logps": b["ref_logps"][P:]}
    return trl_fault(t._compute_loss(head_model(model, head, 1.0), inputs, return_outputs=False))

