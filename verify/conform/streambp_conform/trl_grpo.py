"""TRL's GRPOTrainer driven through its own train() on an RL step case (docs/rl-steps.md), with streambp_conform.rl's
stand-ins and nothing else replaced: generation (the case's raw completions after TRL's left-padded prompts), the
reward models (one function per reward column), TRL's fused LM head (by TRL's own log-softmax on the fp64 logits, each
row at its unpadded positions: rl.trl_fp64_head), the optimizer (plain SGD at the case's learning_rate, clipping off)
and, in `layout="case"`, TRL's random shuffle of the generation batch (by the case's micro_batches).

    from streambp_conform import trl_grpo
    record = trl_grpo.train(case.rl, case.model_dir)              # the Record of rl.py: gradients, stages, rows

What differs between TRL releases lives in `Pin` (one place): a release that lacks a GRPOConfig field the case sets
to the behaviour the release has anyway drops it; one that cannot express the setting is NotExpressible. A trainer bug
to plant (tests/support) is a `Hooks`: the generation batch TRL hands its loss, or one micro-step's loss inputs.
torch, transformers and trl are imported when train() runs.
"""
import dataclasses
import tempfile
from pathlib import Path

from streambp_conform import rl
from streambp_conform.protocol import NotExpressible

# The case's keys that are the oracle's, not GRPOConfig's: plain SGD's step, the token ids the tokenizer gets.
ORACLE_ONLY = ("learning_rate", "eos_token_id", "pad_token_id")


@dataclasses.dataclass
class Hooks:
    """Where a planted bug goes (None: TRL as it is). `scored(out, trainer)`: the generation batch TRL's
    _generate_and_score_completions returns, before the stages are recorded; `loss_inputs(inputs, trainer)`: one
    micro-step's inputs to TRL's _compute_loss."""
    scored: object = None
    loss_inputs: object = None


@dataclasses.dataclass
class Pin:
    """What this driver needs of a TRL release, by name: where GRPOTrainer finds the shuffle of its generation batch,
    its scoring and log-prob methods, and for a GRPOConfig field a release lacks, the value that is its behaviour
    without it (the case may set that value; another is NotExpressible)."""
    shuffle: str = "shuffle_sequence_dict"
    score: str = "_generate_and_score_completions"
    logps: str = "_get_per_token_logps_and_entropies"
    compute_loss: str = "_compute_loss"
    without: dict = dataclasses.field(default_factory=lambda: {
        "use_bias_correction_kl": False, "num_iterations": 1, "mask_truncated_completions": False,
        "importance_sampling_level": "token", "epsilon_high": None, "steps_per_generation": None})

    def config_kwargs(self, settings, fields):
        """GRPOConfig's keyword arguments for the case's settings in a release whose config has `fields`."""
        out = {}
        for key, value in settings.items():
            if key in ORACLE_ONLY:
                continue
            if key in fields:
                out[key] = value
                continue
            implied = self.without.get(key, KeyError)
            if key == "epsilon_high":
                implied = settings.get("epsilon", 0.2)
            if key == "steps_per_generation":
                implied = settings.get("gradient_accumulation_steps")
            if implied is KeyError or value != implied:
                raise NotExpressible(f"GRPOConfig of this TRL has no {key} (the case sets {value!r})")
        if isinstance(out.get("scale_rewards"), str) and "scale_rewards" in fields \
                and fields["scale_rewards"].type in (bool, "bool"):
            if out["scale_rewards"] == "batch":  # releases whose scale_rewards is a bool: per group or not at all
                raise NotExpressible("scale_rewards batch: this TRL's scale_rewards is a bool (group or none)")
            out["scale_rewards"] = out["scale_rewards"] == "group"
        return out


def pin(version):
    """The Pin of a TRL release (1.16.0 and the releases with its names; add a release's differences here)."""
    return Pin()


def word(case, i):
    """Token i as a word: the pad and EOS tokens with names that are no prefix of a word (TRL's tokenizer matches
    special tokens inside words), any other "w{i}"."""
    return {case.pad: "<pad>", case.eos: "<eos>"}.get(i, f"w{i}")


def text(case, ids):
    return " ".join(word(case, i) for i in ids)


def tokenizer(case, vocab_size):
    """A word-level tokenizer whose token i is word(case, i): prompts written as text read back exactly."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    unk = next(i for i in range(vocab_size) if i not in (case.pad, case.eos))
    tok = Tokenizer(models.WordLevel(vocab={word(case, i): i for i in range(vocab_size)}, unk_token=word(case, unk)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=word(case, case.pad),
                                                eos_token=word(case, case.eos), unk_token=word(case, unk))


def optimizer_steps(case):
    s = case.settings
    spg = s.get("steps_per_generation") or s["gradient_accumulation_steps"]
    return spg * s.get("num_iterations", 1) // s["gradient_accumulation_steps"]


def train(case, model_dir, layout="case", hooks=None, seed=3):
    """TRL's GRPOTrainer.train() in fp64 over the case's one generation batch; the rl.Record of what it did: the case
    row of each generated row, the permutation it cut into micro-batches (`layout` "case": the case's micro_batches;
    "trl": TRL's own shuffle, recorded), the gradient its optimizer received at every optimizer step, and its
    advantages, completion mask and per-token log-probs at generation time (TRL's own log-prob pass on the generation
    batch it hands its loss, before any update)."""
    import torch
    import transformers
    import trl
    import trl.trainer.grpo_trainer as grpo_module
    from datasets import Dataset

    hooks = hooks or Hooks()
    p = pin(trl.__version__)
    for where, name in ((grpo_module, p.shuffle), (trl.GRPOTrainer, p.score), (trl.GRPOTrainer, p.logps),
                        (trl.GRPOTrainer, p.compute_loss)):
        if not hasattr(where, name):  # a release this Pin does not describe: say so rather than run another path
            raise NotExpressible(f"TRL {trl.__version__} has no {getattr(where, '__name__', where)}.{name}: "
                                 "describe the release in streambp_conform.trl_grpo.pin()")
    s = case.settings
    record = rl.Record()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="sdpa")
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = case.eos, case.pad
    model.generate = rl.generate_stand_in(case, record)
    steps = optimizer_steps(case)
    fields = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}
    work = tempfile.TemporaryDirectory(prefix="streambp-trl-grpo-")  # TRL's output_dir: nothing is saved there
    config = trl.GRPOConfig(output_dir=str(Path(work.name) / "trl"), report_to=[], use_cpu=True, save_strategy="no",
                            logging_steps=1000, max_steps=steps, max_grad_norm=0.0, seed=seed,
                            **p.config_kwargs(s, fields))
    optimizer = torch.optim.SGD(model.parameters(), lr=s.get("learning_rate", 0.0))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    dataset = Dataset.from_dict({"prompt": [text(case, q) for q in case.prompts]})
    trainer = trl.GRPOTrainer(model=model, args=config, train_dataset=dataset,
                              processing_class=tokenizer(case, model.config.vocab_size),
                              reward_funcs=rl.reward_functions(case, lambda ids: text(case, ids)),
                              optimizers=(optimizer, schedule), callbacks=[rl.optimizer_gradients(model, record)])
    model.forward = rl.trl_fp64_head(model, config.temperature)  # after TRL installed its fused head
    if trainer.ref_model is not None:
        trainer.ref_model.forward = rl.trl_fp64_head(trainer.ref_model, config.temperature)

    score, logps = getattr(trainer, p.score), getattr(trainer, p.logps)

    def recording_score(inputs):  # TRL's generation batch: its advantages, completion mask and log-probs recorded
        out = score(inputs)
        if hooks.scored:
            out = hooks.scored(out, trainer)
        record.advantages = out["advantages"].detach().clone()
        record.completion_mask = out["completion_mask"].detach().clone()
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        with torch.no_grad():
            record.token_logps = logps(trainer.model, ids, mask, out["completion_ids"].size(1))[0].detach().clone()
        return out
    setattr(trainer, p.score, recording_score)
    if hooks.loss_inputs:
        compute_loss = getattr(trainer, p.compute_loss)
        setattr(trainer, p.compute_loss, lambda model, inputs: compute_loss(model, hooks.loss_inputs(inputs, trainer)))
    shuffled = rl.case_layout(grpo_module, case, record, p.shuffle) if layout == "case" else \
        rl.recorded_shuffle(grpo_module, record, p.shuffle)
    torch.set_default_dtype(torch.float64)  # TRL builds its reward table in it; the cases' rewards are exact in fp32
    try:
        with shuffled:
            trainer.train()
    finally:
        torch.set_default_dtype(torch.float32)
        work.cleanup()
    if len(record.gradients) != steps:
        raise RuntimeError(f"TRL took {len(record.gradients)} optimizer steps, the case has {steps}")
    return record
