"""TRL's GRPOTrainer driven through its own train() on an RL step case (docs/rl-steps.md), with streambp_conform.rl's
stand-ins and nothing else replaced: generation (the case's raw completions after TRL's left-padded prompts), the
reward models (one function per reward column), TRL's fused LM head (by TRL's own log-softmax on the fp64 logits, each
row at its unpadded positions: rl.trl_fp64_head), the optimizer (plain SGD at the case's learning_rate, clipping off)
and, in `layout="case"`, TRL's random shuffle of the generation batch (by the case's micro_batches).

    from streambp_conform import trl_grpo
    record = trl_grpo.train(case.rl, case.model_dir)              # the Record of rl.py: gradients, stages, rows

What differs between TRL releases lives in `Pin` (one place; pin() gives 0.14.0 to 1.16.0): the hooked names, the
reward functions' arguments, 0.14's generation and batch size; a release that lacks a GRPOConfig field the case sets
to the behaviour the release has anyway drops it; one that cannot express the setting is NotExpressible. A trainer bug
to plant (tests/support) is a `Hooks`: the generation batch TRL hands its loss, or one micro-step's loss inputs.
torch, transformers and trl are imported when train() runs.
"""
import contextlib
import dataclasses
import tempfile
from pathlib import Path

from streambp_conform import rl
from streambp_conform.protocol import NotExpressible

# The case's keys that are the oracle's, not GRPOConfig's: plain SGD's step, the token ids the tokenizer gets.
ORACLE_ONLY = ("learning_rate", "eos_token_id", "pad_token_id")


@dataclasses.dataclass
class Hooks:
    """Where a planted bug goes (None: TRL as it is). `scored(out, trainer)`: the generation batch TRL's scoring
    method returns, before the stages are recorded; `loss_inputs(inputs, trainer)`: one micro-step's inputs to TRL's
    loss; `model_call(args, kwargs)`: the keyword arguments of every call of the policy and the reference model,
    returned changed (a diagnosis of what a release passes them)."""
    scored: object = None
    loss_inputs: object = None
    model_call: object = None


# What a release without an option does anyway (the case may state it; another value is NotExpressible).
LATER_OPTIONS = {"use_bias_correction_kl": False, "num_iterations": 1, "mask_truncated_completions": False,
                 "importance_sampling_level": "token"}


@dataclasses.dataclass
class Pin:
    """What this driver needs of a TRL release, by name: where GRPOTrainer finds the shuffle of its generation batch
    (None: a release that generates once per micro-batch, so the case's generation batch must be one micro-batch),
    its scoring method (None: 0.14 scores inside compute_loss, its stages are not returned), its log-prob method, its
    loss method, whether it loads the reference model by GRPOConfig.model_init_kwargs (0.14-0.16 copy the policy and
    refuse them), whether its reward functions get completion_ids (before 0.18 the decoded text alone), whether it
    asks generate for all of a prompt's completions at once (0.14: num_return_sequences), whether its
    per_device_train_batch_size counts prompts (0.14), and for a GRPOConfig field a release lacks, the value that is
    its behaviour without it."""
    shuffle: str = "shuffle_sequence_dict"
    score: str = "_generate_and_score_completions"
    logps: str = "_get_per_token_logps_and_entropies"
    compute_loss: str = "_compute_loss"
    reward_ids: bool = True
    batch_counts_prompts: bool = False
    ref_by_init_kwargs: bool = True  # the reference model loaded by model_init_kwargs (before: a copy of the policy)
    without: dict = dataclasses.field(default_factory=lambda: dict(LATER_OPTIONS, epsilon_high=None,
                                                                   steps_per_generation=None))

    def config_kwargs(self, settings, fields, rows=None):
        """GRPOConfig's keyword arguments for the case's settings (`rows` completions in its generation batch) in a
        release whose config has `fields`."""
        if self.shuffle is None and rows is not None and (settings.get("per_device_train_batch_size") != rows or
                                                         settings.get("gradient_accumulation_steps", 1) != 1):
            raise NotExpressible("this TRL generates once per micro-batch: the case's generation batch must be one "
                                 f"micro-batch of its {rows} completions (gradient_accumulation_steps 1)")
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
            if key == "reward_weights":  # 0.14 sums its reward functions
                implied = [1.0] * len(value)
            if key == "scale_rewards" and value in (True, False):  # the bool of releases before 0.22
                value = "group" if value else "none"
            if key == "use_bias_correction_kl" and (settings.get("beta", 0.0) == 0.0
                                                    or optimizer_steps_of(settings) == 1):
                continue  # the KL term's value and gradient are 0 while the policy is the reference (no update yet)
            if implied is KeyError or value != implied:
                raise NotExpressible(f"GRPOConfig of this TRL has no {key} (the case sets {value!r})")
        if isinstance(out.get("scale_rewards"), str) and "scale_rewards" in fields \
                and fields["scale_rewards"].type in (bool, "bool"):
            if out["scale_rewards"] == "batch":  # releases whose scale_rewards is a bool: per group or not at all
                raise NotExpressible("scale_rewards batch: this TRL's scale_rewards is a bool (group or none)")
            out["scale_rewards"] = out["scale_rewards"] == "group"
        if self.batch_counts_prompts and "per_device_train_batch_size" in out:
            out["per_device_train_batch_size"] //= settings.get("num_generations", 2)
        return out


def version_tuple(version):
    return tuple(int(x) for x in version.split("+")[0].split(".")[:3] if x.isdigit())


def pin(version):
    """The Pin of a TRL release: 1.16.0 and the releases with its names (0.22.x, 1.8.0, 1.9.0, 1.9.1 run the rl
    set), and the first GRPOTrainers (0.14.0-0.16.0), which have one loss and one micro-batch per generation. A
    release this does not describe is found out by train(): a missing name is NotExpressible."""
    v = version_tuple(version)
    if v >= (0, 20):
        return Pin()
    # before 0.17 there is no loss_type: 0.16 normalises by the micro-batch's tokens (PR #2881), earlier releases
    # take the mean of the rows' token means; there is no steps_per_generation, and before 0.16 no epsilon
    # (no clipping) and no scale_rewards (always the group's std)
    without = dict(LATER_OPTIONS, steps_per_generation=None, epsilon_high=None,
                   loss_type="bnpo" if v >= (0, 16) else "grpo")
    if v < (0, 16):
        # no clipping: with num_iterations 1 the ratio is 1 and TRL's default epsilon states the same objective
        without.update(scale_rewards="group", epsilon=0.2)
    if v >= (0, 16):
        return Pin(shuffle=None, logps="_get_per_token_logps", compute_loss="compute_loss", reward_ids=False,
                   ref_by_init_kwargs=False, without=without)
    if v >= (0, 15):
        return Pin(shuffle=None, score="_prepare_inputs", logps="_get_per_token_logps", compute_loss="compute_loss",
                   reward_ids=False, ref_by_init_kwargs=False, without=without)
    return Pin(shuffle=None, score=None, logps=None, compute_loss="compute_loss", reward_ids=False,
               batch_counts_prompts=True, ref_by_init_kwargs=False, without=without)


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

    unk = unknown(case)
    tok = Tokenizer(models.WordLevel(vocab={word(case, i): i for i in range(vocab_size)}, unk_token=word(case, unk)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=word(case, case.pad),
                                                eos_token=word(case, case.eos), unk_token=word(case, unk))


def optimizer_steps(case):
    return optimizer_steps_of(case.settings)


def optimizer_steps_of(s):
    spg = s.get("steps_per_generation") or s["gradient_accumulation_steps"]
    return spg * s.get("num_iterations", 1) // s["gradient_accumulation_steps"]


def reward_functions(case, p):
    """rl.reward_functions; for a release whose reward functions get no completion_ids, a lookup by the decoded
    completion (its words without the special tokens, as TRL decodes it: the raw generation's, which 0.16 decodes, or
    the kept completion's; distinct on the rl cases)."""
    by_ids = rl.reward_functions(case, lambda ids: text(case, ids))
    if p.reward_ids:
        return by_ids
    specials = {case.pad, case.eos, unknown(case)}
    table = {}
    for r in range(len(case.completions)):
        for ids in (case.completions[r], case.kept(r)):
            words = text(case, [t for t in ids if t not in specials])
            table[(text(case, case.prompts[r // case.group]), words)] = case.rewards[r]

    def column(f):
        def reward(prompts, completions, **kwargs):
            return [table[(q, c.strip())][f] for q, c in zip(prompts, completions)]
        reward.__name__ = f"reward_{f}"
        return reward
    return [column(f) for f in range(len(case.rewards[0]))]


def unknown(case):
    return next(i for i in range(3) if i not in (case.pad, case.eos))


def generate(case, record):
    """rl.generate_stand_in; for a release that asks for all of a prompt's completions in one call
    (num_return_sequences, 0.14), each prompt row repeated that many times first."""
    stand_in = rl.generate_stand_in(case, record)

    def call(input_ids, attention_mask, generation_config=None, **kwargs):
        n = getattr(generation_config, "num_return_sequences", None) or 1
        return stand_in(input_ids.repeat_interleave(n, 0), attention_mask.repeat_interleave(n, 0))
    return call


def install_head(model, temperature, hooks):
    model.forward = rl.trl_fp64_head(model, temperature)
    if hooks.model_call:
        head = model.forward
        model.forward = lambda *args, **kwargs: head(*args, **hooks.model_call(args, kwargs))


def train(case, model_dir, layout="case", hooks=None, seed=3):
    """TRL's GRPOTrainer.train() in fp64 over the case's one generation batch; the rl.Record of what it did: the case
    row of each generated row, the permutation it cut into micro-batches (`layout` "case": the case's micro_batches;
    "trl": TRL's own shuffle, recorded), the gradient its optimizer received at every optimizer step, and its
    advantages, completion mask and per-token log-probs at generation time (TRL's own log-prob pass on the generation
    batch it hands its loss, before any update; not recorded for a release without a scoring method)."""
    import torch
    import transformers
    import trl
    import trl.trainer.grpo_trainer as grpo_module
    from datasets import Dataset

    hooks = hooks or Hooks()
    p = pin(trl.__version__)
    for where, name in ((grpo_module, p.shuffle), (trl.GRPOTrainer, p.score), (trl.GRPOTrainer, p.logps),
                        (trl.GRPOTrainer, p.compute_loss)):
        if name is not None and not hasattr(where, name):  # a release this Pin does not describe: say so
            raise NotExpressible(f"TRL {trl.__version__} has no {getattr(where, '__name__', where)}.{name}: "
                                 "describe the release in streambp_conform.trl_grpo.pin()")
    s = case.settings
    record = rl.Record()
    fields = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}
    kwargs = p.config_kwargs(s, fields, len(case.completions))
    # from_pretrained's dtype argument is torch_dtype before transformers 4.56
    dtype = "dtype" if version_tuple(transformers.__version__)[:2] >= (4, 56) else "torch_dtype"
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa",
                                                              **{dtype: torch.float64})
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = case.eos, case.pad
    model.generate = generate(case, record)
    steps = optimizer_steps(case)
    work = tempfile.TemporaryDirectory(prefix="streambp-trl-grpo-")  # TRL's output_dir: nothing is saved there
    if p.ref_by_init_kwargs:  # the reference model (beta > 0) in fp64 too: 1.9 and earlier load it by these, by
        kwargs["model_init_kwargs"] = {dtype: torch.float64}  # default in fp32 (the given policy ignores them)
    config = trl.GRPOConfig(output_dir=str(Path(work.name) / "trl"), report_to=[], use_cpu=True, save_strategy="no",
                            logging_steps=1000, max_steps=steps, max_grad_norm=0.0, seed=seed, **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=s.get("learning_rate", 0.0))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    dataset = Dataset.from_dict({"prompt": [text(case, q) for q in case.prompts]})
    trainer = trl.GRPOTrainer(model=model, args=config, train_dataset=dataset,
                              processing_class=tokenizer(case, model.config.vocab_size),
                              reward_funcs=reward_functions(case, p),
                              optimizers=(optimizer, schedule), callbacks=[rl.optimizer_gradients(model, record)])
    temperature = getattr(config, "temperature", 1.0)
    install_head(model, temperature, hooks)  # after TRL installed its fused head (releases after 1.9)
    if getattr(trainer, "ref_model", None) is not None:
        install_head(trainer.ref_model, temperature, hooks)

    if p.score is not None:
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
                lp = logps(trainer.model, ids, mask, out["completion_ids"].size(1))
            record.token_logps = (lp[0] if isinstance(lp, tuple) else lp).detach().clone()
            return out
        setattr(trainer, p.score, recording_score)
    if hooks.loss_inputs:
        compute_loss = getattr(trainer, p.compute_loss)
        setattr(trainer, p.compute_loss, lambda model, inputs, *args, **kwargs:
                compute_loss(model, hooks.loss_inputs(inputs, trainer), *args, **kwargs))
    if p.shuffle is None:  # one micro-batch per generation (config_kwargs checked it): no layout to impose
        shuffled = contextlib.nullcontext()
    else:
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
