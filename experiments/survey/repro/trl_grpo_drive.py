"""TRL's GRPOTrainer.train() on one RL step case, judged by the harness's RL step oracle (`streambp rl-step`,
docs/rl-steps.md), at whichever trl the running venv has: the drive of tests/oracle/rl_step_parity.py (its case, its
tokenizer, the adapter side of verify/conform/streambp_conform/rl.py), made to run at older releases too.

What differs between trl releases is in `Api` below, and nothing else:
  - the loss's log-probs: releases after 1.9 (1.16.0 among them) call the model with a fused LM head (fp32 tiles),
    replaced as in the parity test by TRL's own unfused log-softmax on the fp64 logits (rl.trl_fp64_head); 1.9 and
    earlier compute the log-probs from the model's logits themselves, so only the positions are given (each row its
    unpadded sequence's, cumsum(attention_mask) - 1: HF's RoPE table is fp32, the same function in exact arithmetic);
  - the methods that compute them (`_get_per_token_logps_and_entropies`, `_get_per_token_logps` before 0.20) and
    the advantages and mask (`_generate_and_score_completions`, `_prepare_inputs` before 0.16);
  - the shuffle of the generation batch (`shuffle_sequence_dict`; `shuffle_tensor_dict` in 0.18 and 0.19; none before:
    one micro-batch per generation), and 0.14's one `generate` call for all of a prompt's completions;
  - the reward functions' arguments (`completion_ids` since 0.18; before, the decoded completion text alone);
  - the settings: GRPOConfig takes those of the case it has; the others are what the release does without an option
    (its one loss, its one reward scaling), which the case states for the oracle and the result lists as `declared`.
The case's settings are always the oracle's: a release's behaviour is judged against what its own documentation
and options say it computes.

Used by trl_grpo_bugs.py, in each pin's venv: run(binary, model_dir, settings, work, overrides) -> the comparison, a
dict. Run at trl 0.14.0, 0.15.0, 0.15.2, 0.16.0, 0.22.1, 0.22.2, 1.8.0, 1.9.0 and the harness's 1.16.0.
"""
import contextlib
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "oracle"))
sys.path.insert(0, str(ROOT / "verify" / "conform"))

import rl_step_parity as parity  # noqa: E402  (its case, tokenizer and texts; it imports torch, transformers, trl)
from streambp_conform import rl  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
import trl.trainer.grpo_trainer as grpo_module  # noqa: E402
import trl.trainer.utils as trl_utils  # noqa: E402


class Api:
    """The release-dependent parts of the drive (see the module docstring)."""

    fused_head = hasattr(trl_utils, "FusedCausalLMOutput")
    # None: 0.14 generates, scores and takes the log-probs inside compute_loss (only the gradients are judged)
    logps_method = next((m for m in ("_get_per_token_logps_and_entropies", "_get_per_token_logps")
                         if hasattr(trl.GRPOTrainer, m)), None)
    # before 0.16 _prepare_inputs scores; 0.14's _prepare_inputs returns its inputs as they are
    score_method = ("_generate_and_score_completions" if hasattr(trl.GRPOTrainer, "_generate_and_score_completions")
                    else "_prepare_inputs" if logps_method else None)
    shuffle_name = next((n for n in ("shuffle_sequence_dict", "shuffle_tensor_dict") if hasattr(grpo_module, n)), None)
    config_fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    mask_from_pads = False  # a diagnosis: hand a model call without an attention mask the one its pad tokens give
    # from_pretrained's dtype argument: `torch_dtype` before transformers 4.56
    dtype_kwarg = "dtype" if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (4, 56) else "torch_dtype"

    @staticmethod
    def install_head(model, temperature):
        if Api.fused_head:
            model.forward = rl.trl_fp64_head(model, temperature)
            return
        forward = type(model).forward

        def with_positions(*args, **kwargs):
            if Api.mask_from_pads and kwargs.get("attention_mask") is None:  # the diagnosis of PR #2708 only
                ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
                kwargs["attention_mask"] = (ids != parity.PAD).long()
            if kwargs.get("position_ids") is None and kwargs.get("attention_mask") is not None:
                kwargs["position_ids"] = (kwargs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
            return forward(model, *args, **kwargs)
        model.forward = with_positions

    @staticmethod
    def generate(case, record):
        """rl.generate_stand_in; for 0.14, which asks for all of a prompt's completions at once
        (num_return_sequences), each prompt row repeated that many times first."""
        stand_in = rl.generate_stand_in(case, record)

        def generate(input_ids, attention_mask, generation_config=None, **kwargs):
            n = getattr(generation_config, "num_return_sequences", None) or 1
            return stand_in(input_ids.repeat_interleave(n, 0), attention_mask.repeat_interleave(n, 0))
        return generate

    @staticmethod
    def reward_functions(case):
        """rl.reward_functions, and for releases that pass no completion_ids a lookup by the decoded text (the raw
        generation's or the kept completion's words, specials skipped: distinct on the case)."""
        by_ids = rl.reward_functions(case, parity.text)
        table = {}
        for r in range(len(case.completions)):
            prompt = parity.text(case.prompts[r // case.group])
            for ids in (case.completions[r], case.kept(r)):
                words = [t for t in ids if t not in (parity.EOS, parity.PAD, parity.UNK)]
                table[(prompt, parity.text(words))] = case.rewards[r]

        def column(f, by_id):
            def reward(prompts, completions, completion_ids=None, **kwargs):
                if completion_ids is not None:
                    return by_id(prompts, completions, completion_ids)
                return [table[(p, c.strip())][f] for p, c in zip(prompts, completions)]
            reward.__name__ = f"reward_{f}"
            return reward
        return [column(f, g) for f, g in enumerate(by_ids)]

    @staticmethod
    def shuffle(record):
        if Api.shuffle_name is None:
            return contextlib.nullcontext()
        return rl.recorded_shuffle(grpo_module, record, Api.shuffle_name)


def run_trl(model_dir, case, work, overrides=None):
    s = case.settings
    record = rl.Record()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa",
                                                              **{Api.dtype_kwarg: torch.float64})
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = parity.EOS, parity.PAD
    model.generate = Api.generate(case, record)
    spg = s.get("steps_per_generation") or s["gradient_accumulation_steps"]
    steps = spg * s.get("num_iterations", 1) // s["gradient_accumulation_steps"]
    oracle_only = {"learning_rate", "eos_token_id", "pad_token_id"}
    given = {k: v for k, v in s.items() if k not in oracle_only and k in Api.config_fields}
    declared = {k: v for k, v in s.items() if k not in oracle_only and k not in Api.config_fields}
    given.update(overrides or {})  # a field whose meaning the release defines otherwise (0.14: prompts per device)
    config = trl.GRPOConfig(output_dir=str(work / "trl"), report_to=[], use_cpu=True, save_strategy="no",
                            logging_steps=1000, max_steps=steps, max_grad_norm=0.0, seed=3, **given)
    optimizer = torch.optim.SGD(model.parameters(), lr=s.get("learning_rate", 0.0))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    dataset = parity.Dataset.from_dict({"prompt": [parity.text(p) for p in case.prompts]})
    trainer = trl.GRPOTrainer(model=model, args=config, train_dataset=dataset,
                              processing_class=parity.tokenizer(model.config.vocab_size),
                              reward_funcs=Api.reward_functions(case), optimizers=(optimizer, schedule),
                              callbacks=[rl.optimizer_gradients(model, record)])
    temperature = getattr(config, "temperature", 1.0)
    Api.install_head(model, temperature)  # after TRL installed its own head, if any
    if getattr(trainer, "ref_model", None) is not None:
        Api.install_head(trainer.ref_model, temperature)

    record.advantages = record.mask = record.first_logps = None
    if Api.score_method:
        score = getattr(trainer, Api.score_method)

        def recording_score(inputs):
            out = score(inputs)
            record.advantages, record.mask = out["advantages"].detach().clone(), out["completion_mask"].detach().clone()
            return out
        setattr(trainer, Api.score_method, recording_score)
    logps = getattr(trainer, Api.logps_method) if Api.logps_method else None

    def recording_logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        out = logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if torch.is_grad_enabled() and record.first_logps is None:  # the loss's pass of the first micro-step
            lp = out[0] if isinstance(out, tuple) else out
            record.first_logps = (lp.detach().clone(), attention_mask[:, -logits_to_keep:].clone())
        return out
    if logps:
        setattr(trainer, Api.logps_method, recording_logps)
    torch.set_default_dtype(torch.float64)
    try:
        with Api.shuffle(record):
            trainer.train()
    finally:
        torch.set_default_dtype(torch.float32)
    return record, steps, declared


def relative(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=torch.finfo(torch.float64).tiny))


def compare(record, steps, ours):
    """Every stage the parity test judges, as numbers: the advantages, the completion mask, the first micro-batch's
    log-probs (relative max errors), and each step's gradient (normwise, per tensor)."""
    rows = torch.tensor(record.rows)
    adv = mask_mismatch = logps = None  # a stage the release gives no hook for (0.14) is not judged
    if record.advantages is not None:
        adv = relative(record.advantages, ours["advantages"][rows])
        mask_ours = ours["completion_mask"][rows][:, :record.mask.shape[1]]
        mask_mismatch = int((record.mask.to(mask_ours.dtype) != mask_ours).sum())
    if record.first_logps is not None:
        lp, scored = record.first_logps
        order = record.permutation or list(range(len(record.rows)))
        first = torch.tensor([record.rows[j] for j in order[:lp.shape[0]]])
        lp_ours = ours["token_logps"][first][:, :lp.shape[1]]
        where = scored.bool()
        logps = relative(lp[where], lp_ours[where])
    gradients = []
    for k, grads in enumerate(record.gradients, start=1):
        errors = {n: (parity.normwise_error(g, ours[f"step{k}/{n}"]) if f"step{k}/{n}" in ours else float("inf"))
                  for n, g in grads.items()}
        worst = max(errors, key=errors.get)
        gradients.append({"step": k, "worst_tensor": worst, "error": errors[worst]})
    return {"advantages": adv, "completion_mask_mismatches": mask_mismatch, "token_logps": logps,
            "gradients": gradients, "optimizer_steps": len(record.gradients), "case_steps": steps}


def run(binary, model_dir, settings, work, overrides=None, mask_from_pads=False):
    """The case's settings through this venv's TRL and through the oracle; the comparison and its provenance.
    mask_from_pads: the diagnosis of a release that calls the model without an attention mask (see Api)."""
    parity.patch_rms_norms()
    Api.mask_from_pads = mask_from_pads
    work = Path(work)
    case = parity.base_case(settings)
    record, steps, declared = run_trl(model_dir, case, work, overrides)
    case_file, out = work / "case.json", work / "oracle.safetensors"
    case_file.write_text(json.dumps(rl.with_micro_batches(case, record).to_json()))
    p = subprocess.run([str(binary), "rl-step", "--load", str(model_dir), "--case", str(case_file), "--out", str(out),
                        "--force"], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"streambp rl-step: exit {p.returncode}\n{p.stdout}{p.stderr}")
    result = compare(record, steps, parity.load_file(str(out)))
    result.update(trl=trl.__version__, transformers=transformers.__version__, torch=torch.__version__,
                  declared=declared, overrides=overrides or {}, settings=case.settings, fused_head=Api.fused_head)
    return result
