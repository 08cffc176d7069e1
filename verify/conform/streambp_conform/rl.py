"""What a trainer that generates needs to be judged by the RL step oracle (`streambp rl-step`, docs/rl-steps.md):
generation and the reward models replaced by a case's values, and the gradient read where the optimizer receives it.

    from streambp_conform import rl

    case = rl.read_rl_case("case.json")
    record = rl.Record()
    model.generate = rl.generate_stand_in(case, record)          # the case's raw completions, after TRL's prompts
    reward_funcs = rl.reward_functions(case, tokenizer.decode)    # one function per reward column
    trainer = GRPOTrainer(..., reward_funcs=reward_funcs, callbacks=[rl.optimizer_gradients(model, record)])
    with rl.recorded_shuffle(trl.trainer.grpo_trainer, record):  # TRL's permutation of the generation batch
        trainer.train()
    case_with_layout = rl.with_micro_batches(case, record)        # the micro-batches TRL ran, as case rows

Everything else is the trainer's own code: its padding, its EOS mask, its advantages, its micro-batches, its loss.
torch and transformers are imported where used, not with the package.
"""
import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RlCase:
    """A case file of `streambp rl-step` (docs/rl-steps.md "The case file")."""
    prompts: list
    completions: list  # raw generations, P x G, row r answers prompt r // G
    rewards: list      # per completion, one value per reward function
    settings: dict
    micro_batches: list = field(default_factory=list)

    @property
    def group(self):
        return self.settings.get("num_generations", 2)

    @property
    def eos(self):
        return self.settings.get("eos_token_id", 1)

    @property
    def pad(self):
        return self.settings.get("pad_token_id", 0)

    def kept(self, r):
        """Completion r as the trainer must keep it: up to and including its first EOS, or all of it."""
        raw = self.completions[r]
        return raw[:raw.index(self.eos) + 1] if self.eos in raw else list(raw)

    def to_json(self):
        return {"prompts": self.prompts, "completions": self.completions, "rewards": self.rewards,
                "micro_batches": self.micro_batches, "settings": self.settings}


def read_rl_case(path):
    j = json.loads(Path(path).read_text())
    return RlCase(j["prompts"], j["completions"], j["rewards"], j.get("settings", {}), j.get("micro_batches", []))


class Record:
    """What the trainer did, in its own order: the case row of each generated row, its permutation of the generation
    batch (rows of the generation batch in the order it cut them into micro-batches), and the gradient the optimizer
    received at each step ({name: tensor})."""

    def __init__(self):
        self.rows, self.permutation, self.gradients = [], None, []


def generate_stand_in(case, record):
    """A model's `generate` that returns the trainer's (left-padded) prompts followed by the case's raw completions,
    right-padded with the case's pad token: the tokens after an EOS are there, so the trainer's own mask must drop
    them. A prompt's k-th row in a call gets its k-th completion."""
    import torch

    def generate(input_ids, attention_mask, **kwargs):
        seen = {}
        outputs = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            prompt = [t for t, m in zip(ids, mask) if m]
            p = case.prompts.index(prompt)
            row = p * case.group + seen.get(p, 0)
            seen[p] = seen.get(p, 0) + 1
            record.rows.append(row)
            outputs.append(case.completions[row])
        width = max(len(c) for c in outputs)
        tail = torch.tensor([c + [case.pad] * (width - len(c)) for c in outputs], dtype=input_ids.dtype)
        return torch.cat([input_ids.cpu(), tail], dim=1).to(input_ids.device)
    return generate


def reward_functions(case, prompt_text):
    """One reward function per reward column, in TRL's signature (prompts, completions, completion_ids, **kwargs):
    each returns the case's reward of (prompt, kept completion). `prompt_text(ids)` is the prompt as the dataset
    spells it. A completion the trainer kept otherwise than the case says has no reward: KeyError naming it."""
    table = {(prompt_text(case.prompts[r // case.group]), tuple(case.kept(r))): case.rewards[r]
             for r in range(len(case.completions))}

    def column(f):
        def reward(prompts, completions, completion_ids, **kwargs):
            return [table[(p, tuple(ids))][f] for p, ids in zip(prompts, completion_ids)]
        reward.__name__ = f"reward_{f}"
        return reward
    return [column(f) for f in range(len(case.rewards[0]))]


def optimizer_gradients(model, record):
    """A transformers TrainerCallback that copies every parameter's gradient when the optimizer is about to step."""
    import transformers

    class OptimizerGradients(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            record.gradients.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    return OptimizerGradients()


@contextlib.contextmanager
def recorded_shuffle(module, record, name="shuffle_sequence_dict"):
    """While alive, `module.name` (TRL's shuffle of the generation batch) records the permutation it drew."""
    import torch

    shuffle = getattr(module, name)

    def recording(d):
        out = shuffle(dict(d, _streambp_row=torch.arange(len(record.rows))))
        record.permutation = out.pop("_streambp_row").tolist()
        return out
    setattr(module, name, recording)
    try:
        yield
    finally:
        setattr(module, name, shuffle)


def with_micro_batches(case, record):
    """The case with the micro-batches the trainer ran, as case rows (its permutation cut into micro-batches)."""
    B = case.settings["per_device_train_batch_size"]
    order = [record.rows[i] for i in (record.permutation or range(len(record.rows)))]
    micro = [order[k:k + B] for k in range(0, len(order), B)]
    return RlCase(case.prompts, case.completions, case.rewards, dict(case.settings), micro)


def trl_fp64_head(model, temperature):
    """A forward for `model` with TRL's fused-head call contract (fused_lm_head=True: per-token log-probs of the
    shifted labels) computed by TRL's own unfused selective_log_softmax_and_entropy on the full logits: exact in fp64,
    where TRL's fused head rounds every logit tile to fp32. Each row gets the positions of its unpadded sequence
    (HF's RoPE table is fp32, so positions shifted by left padding differ by rounding: 5e-8 on the parity cases).
    Install it after the trainer has installed its fused head: `model.forward = trl_fp64_head(model, temperature)`."""
    from trl.trainer.utils import FusedCausalLMOutput, selective_log_softmax_and_entropy

    forward = type(model).forward

    def head(*args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            return forward(model, *args, **({"labels": labels} if labels is not None else {}), **kwargs)
        kwargs.pop("use_cache", None)
        if kwargs.get("position_ids") is None and kwargs.get("attention_mask") is not None:
            kwargs["position_ids"] = (kwargs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        logits = forward(model, *args, use_cache=False, **kwargs).logits[:, :-1]
        shifted = labels[:, 1:]
        mask = shifted != -100
        log_probs, entropy = selective_log_softmax_and_entropy(
            logits, shifted.clamp(min=0), entropy_requires_grad=False, temperature=temperature, row_mask=mask)
        return FusedCausalLMOutput(log_probs=log_probs, entropy=entropy, label_mask=mask)
    return head
