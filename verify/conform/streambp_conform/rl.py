"""What a trainer that generates needs to be judged by the RL step oracle (`streambp rl-step`, `streambp conform
--cases rl`, docs/rl-steps.md): generation and the reward models replaced by a case's values, the case's micro-batch
layout in place of the trainer's shuffle, and the gradient read where the optimizer receives it.

    from streambp_conform import rl, run

    def step(case):                                               # a conform rl_step case: case.rl is the RlCase
        record = rl.Record()
        model.generate = rl.generate_stand_in(case.rl, record)    # the case's raw completions, after TRL's prompts
        reward_funcs = rl.reward_functions(case.rl, tokenizer.decode)  # one function per reward column
        trainer = GRPOTrainer(..., reward_funcs=reward_funcs, callbacks=[rl.optimizer_gradients(model, record)])
        with rl.case_layout(trl.trainer.grpo_trainer, case.rl, record):  # the case's micro-batches, in order
            trainer.train()
        return 0.0, rl.returned_tensors(case.rl, record)          # step{k}/<name>, and the stages recorded

    run(step, rl_steps=True)

`recorded_shuffle` instead keeps the trainer's own shuffle and records it (`with_micro_batches` turns it into a case
for `streambp rl-step`). streambp_conform.trl_grpo drives TRL's GRPOTrainer so, whole.

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

    @classmethod
    def from_json(cls, j):
        return cls(j["prompts"], j["completions"], j["rewards"], j.get("settings", {}), j.get("micro_batches", []))


def read_rl_case(path):
    return RlCase.from_json(json.loads(Path(path).read_text()))


class Record:
    """What the trainer did, in its own order: the case row of each generated row, its permutation of the generation
    batch (rows of the generation batch in the order it cut them into micro-batches), and the gradient the optimizer
    received at each step ({name: tensor})."""

    def __init__(self):
        self.rows, self.permutation, self.gradients = [], None, []
        # The trainer's own view of the generation batch, in its row order (None: not recorded): advantages [N],
        # completion_mask [N, C'] and per-token log-probs at generation time [N, C'], C' its completions' width.
        self.advantages = self.completion_mask = self.token_logps = None


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


def _permuted(d, permutation):
    """Every sequence-like value of a generation batch dict in `permutation`'s order (0-d tensors and None as they are)."""
    import torch

    def permute(v):
        if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0):
            return v
        if isinstance(v, torch.Tensor):
            return v[permutation]
        return [v[i] for i in permutation.tolist()]
    return {k: permute(v) for k, v in d.items()}


@contextlib.contextmanager
def case_layout(module, case, record, name="shuffle_sequence_dict"):
    """While alive, `module.name` (the trainer's shuffle of the generation batch before it cuts it into micro-batches)
    puts the generation batch in the order of the case's micro_batches instead of a random one: the trainer then runs
    the case's micro-batches, in order (as case rows: record.rows maps the generated rows to them)."""
    import torch

    shuffle = getattr(module, name)

    def layout(d):
        order = [r for micro in case.micro_batches for r in micro] or list(range(len(record.rows)))
        if sorted(order) != sorted(record.rows):
            raise ValueError(f"the case's micro_batches {case.micro_batches} are not the generated rows {record.rows}")
        record.permutation = [record.rows.index(r) for r in order]
        return _permuted(d, torch.tensor(record.permutation))
    setattr(module, name, layout)
    try:
        yield
    finally:
        setattr(module, name, shuffle)


def returned_tensors(case, record):
    """What an rl_step case returns (docs/conformance.md): the gradient of every optimizer step as "step{k}/<name>",
    and the stages the record holds (advantages, completion_mask, token_logps), put in the case's row order and padded
    to max_completion_length (zeros: a kept completion is never longer)."""
    import torch

    out = {f"step{k}/{n}": g for k, grads in enumerate(record.gradients, start=1) for n, g in grads.items()}
    C = case.settings["max_completion_length"]
    to_case = torch.tensor([record.rows.index(r) for r in range(len(case.completions))])
    for key in ("advantages", "completion_mask", "token_logps"):
        v = getattr(record, key)
        if v is None:
            continue
        v = v.detach().to(torch.float64)[to_case]
        if v.ndim == 2:
            v = torch.nn.functional.pad(v[:, :C], (0, C - min(C, v.size(1))))
        out[key] = v
    return out


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
    forward = type(model).forward

    def head(*args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if kwargs.get("position_ids") is None and kwargs.get("attention_mask") is not None:
            kwargs["position_ids"] = (kwargs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        if not fused_lm_head:  # a pin without the fused head: its own log-softmax on the fp64 logits is exact
            return forward(model, *args, **({"labels": labels} if labels is not None else {}), **kwargs)
        from trl.trainer.utils import FusedCausalLMOutput, selective_log_softmax_and_entropy

        kwargs.pop("use_cache", None)
        logits = forward(model, *args, use_cache=False, **kwargs).logits[:, :-1]
        shifted = labels[:, 1:]
        mask = shifted != -100
        log_probs, entropy = selective_log_softmax_and_entropy(
            logits, shifted.clamp(min=0), entropy_requires_grad=False, temperature=temperature, row_mask=mask)
        return FusedCausalLMOutput(log_probs=log_probs, entropy=entropy, label_mask=mask)
    return head
