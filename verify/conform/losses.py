"""The three objectives of the conformance protocol on an HF model's logits.

SFT is HF's own loss. GRPO and DPO are TRL's formulas, written out as tests/oracle/lora_parity.py has them
(GRPOTrainer._compute_loss; DPOTrainer's sigmoid loss), not TRL's code: TRL is not in the project venv (installing
it pulls datasets and pins of its own into an environment other work depends on), and its losses are trainer methods
(`GRPOTrainer._compute_loss(self, model, inputs)` runs the model itself and reads the trainer's config, accelerator
and metrics), not functions of logits that an adapter could call without building a trainer.

Batch layout (core/objectives/batch.h): position t predicts token t + 1, so the log-prob of token t is
log_softmax(logits[t - 1] / temperature)[input_ids[t]]; old_logps / ref_logps [B, T] hold it at entry t (0 off the
completion); DPO's ref_logps [2P] are row sums over completion tokens (the first one included).
The loss arithmetic runs on the logits upcast to at least fp32, as HF's own causal-LM loss does (`logits.float()`),
except that fp64 stays fp64 end to end; the batch's fp64 side tensors are cast to that dtype. In bf16 this decides
whether the adapter passes the harness's low-precision rule: the log-ratios and the k3 KL (exp(d) - d - 1, small d)
cancel, and GRPO in bf16 arithmetic measured 0.25 l2 gradient error against fp64 on the same bf16 weights, 18x the
binary's bf16 standard BP (1.4e-2); from fp32 logits it is 1.3e-2 (tiny, beta=0.04, bnpo). DPO: 2.9x -> 1.2x.
"""
import torch
import torch.nn.functional as F

from protocol import CaseError
from streambp_conform.hf import batch_inputs, model_inputs  # noqa: F401  (model_inputs: the adapters' helper)


def step_batch(case):
    """The batch whose totals normalise the loss: the whole step's (Case.union) on a micro-batch, else the case's own.
    Every loss here is a sum over rows or tokens divided by such a total, so the micro-batches' losses sum to the
    union batch's (HF Trainer's and TRL's num_items_in_batch)."""
    return case.union if case.union is not None else case.batch


def forward_logits(model, b):
    """[B, T, V] in the loss dtype: the model's, raised to at least fp32 (HF's loss upcast, without narrowing fp64).
    `b`: a batch dict (with position_ids: packed rows, each sequence attending within itself)."""
    logits = model(**batch_inputs(b)).logits  # packed rows: position_ids and no mask (streambp_conform.hf)
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


# ------------------------------------------------------------------------------------------------ SFT

def sft_loss(model, case):
    """HF's causal-LM loss: mean cross-entropy over target tokens, labels shifted inside. HF's ForCausalLMLoss
    calls `logits.float()`, which in an fp64 model *rounds* the logits to fp32 (~1e-8 relative loss error); so in fp64
    the same two steps run without that cast: HF's shift (pad -100, drop the first) and HF's fixed_cross_entropy."""
    b = case.batch
    if "labels" not in b:
        raise CaseError("sft: batch.safetensors has no 'labels'")
    # A micro-batch: HF Trainer's num_items_in_batch, the step's target count (None: this batch's own mean).
    items = (step_batch(case)["labels"][:, 1:] != -100).sum() if case.union is not None else None
    if case.dtype != torch.float64:
        return model(**batch_inputs(b), labels=b["labels"], num_items_in_batch=items).loss
    from transformers.loss.loss_utils import fixed_cross_entropy

    logits = forward_logits(model, b)
    shift_labels = F.pad(b["labels"], (0, 1), value=-100)[:, 1:]  # [B, T]: position t's target is token t + 1
    return fixed_cross_entropy(logits.flatten(0, 1), shift_labels.flatten(), num_items_in_batch=items,
                               ignore_index=-100)


# ------------------------------------------------------------------------------------------------ GRPO / DPO

def token_logps(logits, input_ids, temperature):
    """[B, T-1]: entry t-1 = log-prob of token t (TRL's selective_log_softmax of logits / temperature)."""
    logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def grpo_options(o):
    """case.json's GRPOConfig names; a missing key takes current TRL's default."""
    eps = o.get("epsilon", 0.2)
    eps_high = o.get("epsilon_high")
    loss_type = o.get("loss_type", "dapo")
    level = o.get("importance_sampling_level", "token")
    if loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo"):
        raise CaseError(f"grpo: loss_type {loss_type!r}")
    if level not in ("token", "sequence"):
        raise CaseError(f"grpo: importance_sampling_level {level!r}")
    max_len = o.get("max_completion_length")
    if loss_type == "dr_grpo" and max_len is None:
        raise CaseError("grpo: loss_type dr_grpo needs max_completion_length")
    return {"beta": float(o.get("beta", 0.0)), "eps_low": float(eps), "eps_high": float(eps if eps_high is None else eps_high),
            "loss_type": loss_type, "level": level, "temperature": float(o.get("temperature", 1.0)), "max_len": max_len}


def reference(model, case, what):
    """The batch's stored reference log-probs; a LoRA case without them uses TRL's PEFT reference (the base with
    adapters disabled); a full fine-tuning case has no reference model in the protocol."""
    b = case.batch
    if "ref_logps" in b:
        return b["ref_logps"]
    if not case.lora:
        raise CaseError(f"{what}: batch.safetensors has no 'ref_logps' and full fine-tuning has no reference model")
    with torch.no_grad(), model.disable_adapter():
        logits = forward_logits(model, b)
    temperature = grpo_options(case.objective)["temperature"] if what == "grpo" else 1.0
    lp = F.pad(token_logps(logits, b["input_ids"], temperature), (1, 0)) * b["completion_mask"].to(logits.dtype)
    return lp if what == "grpo" else lp.sum(-1)  # grpo [B, T] per token; dpo [2P] row sums


# Packed GRPO (docs/packing.md "GRPO on packed rows", verl's remove-padding layout): each packed sequence is one
# completion with its own advantage (batch["advantages"] [n], cu_seqlens order), and every per-row term of TRL's
# formulas is per sequence: the advantage, the sequence-level ratio's mean log-ratio, grpo's token mean and the count
# of completions grpo and dr_grpo divide by. The hooks below are what a packed path gets wrong
# (tests/support/conform_packing_faults.py replaces them); a padded case never calls them.

def completion_groups(case):
    """A packed case's (group of each scored position [B, T-1], number of groups): which completion token t + 1 of
    each row belongs to, i.e. its sequence (Case.sequence_ids, shifted like the log-probs), over the batch's n."""
    ids = case.sequence_ids
    return ids[:, 1:], int(case.cu_seqlens.numel()) - 1


def position_advantages(case, dtype):
    """[B, T-1]: each scored position's advantage, its sequence's (batch["advantages"] [n], one per sequence)."""
    return case.batch["advantages"].to(dtype)[case.sequence_ids[:, 1:]]


def step_completions(step):
    """How many completions the step's batch holds (grpo's and dr_grpo's count): its packed sequences, the segments
    of position_ids (GRPO's packed rows are full)."""
    return int((step["position_ids"] == 0).sum())


def group_mean(values, mask, groups, n):
    """[n]: each group's mean of `values` over its masked positions (0 for a group without any)."""
    flat = groups.reshape(-1)
    sums = torch.zeros(n, dtype=values.dtype).index_add(0, flat, (values * mask).reshape(-1))
    counts = torch.zeros(n, dtype=values.dtype).index_add(0, flat, mask.reshape(-1))
    return sums / counts.clamp(min=1.0)


def packed_grpo(case):
    """True for a packed GRPO case: its advantages per sequence (case.json per_sequence)."""
    return case.packed and "advantages" in getattr(case, "per_sequence", ())


def grpo_per_token(model, case):
    """TRL GRPOTrainer._compute_loss up to the normalisation: (per-token loss [B, T-1], mask [B, T-1], options)."""
    b, o = case.batch, grpo_options(case.objective)
    for key in ("completion_mask", "advantages"):
        if key not in b:
            raise CaseError(f"grpo: batch.safetensors has no {key!r}")
    ref = reference(model, case, "grpo") if o["beta"] != 0.0 else None  # before the graph: no_grad pass under LoRA
    logits = forward_logits(model, b)
    dt = logits.dtype
    logps = token_logps(logits, b["input_ids"], o["temperature"])  # [B, T-1]
    mask = b["completion_mask"][:, 1:].to(dt)
    # One update per generation (no old_logps): the old policy is the current one, detached (ratio 1, gradient not).
    old = b["old_logps"][:, 1:].to(dt) if "old_logps" in b else logps.detach()
    log_ratio = logps - old
    packed = packed_grpo(case)
    if o["level"] == "token":
        log_w = log_ratio
    elif packed:  # one ratio per packed sequence, broadcast onto its tokens
        groups, n = completion_groups(case)
        log_w = group_mean(log_ratio, mask, groups, n)[groups]
    else:  # one ratio per sequence: exp of the mean log-ratio over its completion tokens
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    coef_2 = torch.clamp(coef_1, 1 - o["eps_low"], 1 + o["eps_high"])
    adv = position_advantages(case, dt) if packed else b["advantages"].to(dt).unsqueeze(1)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if ref is not None:  # k3 estimator of KL(policy || reference)
        r = ref[:, 1:].to(dt)
        per_token = per_token + o["beta"] * (torch.exp(r - logps) - (r - logps) - 1)
    return per_token, mask, o


def grpo_loss(model, case):
    per_token, mask, o = grpo_per_token(model, case)
    step = step_batch(case)  # the normalisers' batch: on a micro-batch, the whole step's
    if packed_grpo(case):  # completions are sequences: the step's count of them is its segments' (rows full)
        rows = step_completions(step)
        if o["loss_type"] == "grpo":
            groups, n = completion_groups(case)
            return group_mean(per_token, mask, groups, n).sum() / rows
    else:
        rows = step["input_ids"].size(0)
    if o["loss_type"] == "grpo":  # mean over sequences of each sequence's token mean
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / rows
    if o["loss_type"] in ("bnpo", "dapo"):  # dapo: the generation batch's token count = this batch's (one process)
        return (per_token * mask).sum() / step["completion_mask"][:, 1:].sum().clamp(min=1).to(mask.dtype)
    return (per_token * mask).sum() / (rows * o["max_len"])  # dr_grpo


def dpo_options(o):
    if o.get("loss_type", "sigmoid") != "sigmoid":
        raise CaseError(f"dpo: loss_type {o.get('loss_type')!r} (sigmoid only)")
    return float(o.get("beta", 0.1)), float(o.get("label_smoothing", 0.0))


def dpo_row_sums(model, case, skip_first=False):
    """[2P] summed log-probs of each row's completion tokens (TRL scores the first one: the last prompt position
    predicts it). skip_first is the public StreamBP code's bug, for the negative control only (wrong_per_chunk.py)."""
    b = case.batch
    if "completion_mask" not in b:
        raise CaseError("dpo: batch.safetensors has no 'completion_mask'")
    logits = forward_logits(model, b)
    mask = b["completion_mask"][:, 1:].to(logits.dtype)  # [2P, T-1]
    if skip_first:
        mask = mask * (mask.cumsum(-1) > 1)
    return (token_logps(logits, b["input_ids"], 1.0) * mask).sum(-1)


def dpo_from_sums(s, ref, beta, ls, pairs=None):
    """TRL DPOTrainer, loss_type="sigmoid": rows 0..P-1 chosen, P..2P-1 rejected; label smoothing as TRL 0.17. The
    mean over pairs; `pairs`: the step's pair count instead of this batch's (a micro-batch's share of the step)."""
    P = s.size(0) // 2
    ref = ref.to(s.dtype)
    z = beta * ((s[:P] - ref[:P]) - (s[P:] - ref[P:]))
    return (-F.logsigmoid(z) * (1 - ls) - F.logsigmoid(-z) * ls).sum() / (pairs or P)


def dpo_loss(model, case):
    beta, ls = dpo_options(case.objective)
    if case.batch["input_ids"].size(0) % 2:
        raise CaseError("dpo: an odd number of rows (P chosen then P rejected)")
    ref = reference(model, case, "dpo")
    return dpo_from_sums(dpo_row_sums(model, case), ref, beta, ls, step_batch(case)["input_ids"].size(0) // 2)


LOSSES = {"sft": sft_loss, "grpo": grpo_loss, "dpo": dpo_loss}


def loss(model, case):
    return LOSSES[case.objective["name"]](model, case)
