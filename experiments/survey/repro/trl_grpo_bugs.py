#!/usr/bin/env python3
"""Known GRPOTrainer bugs of TRL, each fixed in a release, recalled by the harness's RL step oracle (issue #60 item 4):
TRL's own GRPOTrainer.train() at the last release with the bug and at the first with the fix, on one whole-step case
(tests/oracle/rl_step_parity.py's prompts, completions and rewards, in fp64 on the tiny Qwen3), against
`build/streambp rl-step`. The drive is the survey's (verify/conform/streambp_conform/trl_grpo.py: what differs
between releases is in its `Pin`), with TRL's own shuffle recorded.

One command (the harness venv's python; each pin's venv is made as the survey makes its entries', on first use):
    ~/.cache/streambp/venv-torch-2.14.1/bin/python experiments/survey/repro/trl_grpo_bugs.py [--bug NAME ...]
        [--binary build/streambp]

A bug is recalled when its buggy pin fails where the bug acts, naming that stage (advantages, completion_mask,
token_logps, or a step's gradient and its worst tensor) above DIFFER, and its fixed pin passes every stage: the
advantages and log-probs within 1e-12 (relative max), the mask exactly, every gradient within AGREE normwise.
Exits 0 when every bug asked for is recalled.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE))
import pins  # noqa: E402

AGREE, STAGE_RTOL, DIFFER = 1e-13, 1e-12, 1e-6
T456 = ["transformers==4.56.2", "accelerate==1.10.1", "datasets==4.1.1"]   # trl 0.22.x needs >= 4.55
T451 = ["transformers==4.51.3", "accelerate==1.6.0", "datasets==3.5.0"]    # the first with Qwen3
# the harness venv's own, and requests, which trl 1.8 imports
T523 = ["transformers==5.23.0", "accelerate==1.16.0", "datasets==5.2.0", "requests==2.32.5"]


def entry(version, stack, tag):
    return {"name": f"trl-{version}", "venv": f"trl-{version}-{stack[0].replace('==', '-')}",
            "requirements": [f"trl=={version}"] + stack, "tag": tag}


# Each bug: its tracker references, its buggy and fixed pins, the case's settings (GRPOConfig's names; the oracle's
# whole step), per pin where a release has no option for what the case states, and the stage it must fail at.
BUGS = {
    "dapo-truncated-normaliser": {
        "reference": "huggingface/trl PR #6439",
        "bug": "loss_type='dapo' with mask_truncated_completions=True: the normaliser num_items_in_batch counts the "
               "tokens of the truncated completions, which the mask then drops (it is taken before the masking), so "
               "every gradient is too small by the kept share of the generation batch's tokens",
        "pins": [entry("1.8.0", T523, "buggy"), entry("1.9.0", T523, "fixed")],
        "settings": dict(loss_type="dapo", scale_rewards="group", beta=0.0, mask_truncated_completions=True,
                         per_device_train_batch_size=2, gradient_accumulation_steps=2, reward_weights=[1.0, 0.5]),
        "fails_at": "gradient",
    },
    "scale-rewards-swapped": {
        "reference": "huggingface/trl #3991, PR #3992",
        "bug": "scale_rewards: the 'group' branch (the default) divides by nothing and 'none' by the group's std; "
               "'batch' takes the group's std; the advantages are off in all three settings",
        "pins": [entry("0.22.1", T456, "buggy"), entry("0.22.2", T456, "fixed")],
        "settings": dict(loss_type="grpo", scale_rewards="group", beta=0.0, per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, reward_weights=[1.0, 0.5]),
        "fails_at": "advantages",
    },
    "logps-temperature": {
        "reference": "huggingface/trl PR #3029",
        "bug": "the loss's log-probs come from the logits at temperature 1, while the completions were sampled at "
               "GRPOConfig.temperature (0.9 by default): every token's log-prob, ratio and gradient is off",
        "pins": [entry("0.15.2", T451, "buggy"), entry("0.16.0", T451, "fixed")],
        # one micro-batch of the whole generation batch: these releases generate per micro-batch
        "settings": dict(scale_rewards=True, beta=0.04, temperature=0.9, per_device_train_batch_size=4,
                         gradient_accumulation_steps=1, reward_weights=[1.0, 1.0]),
        # each release's only loss: 0.15.2 the mean of the rows' token means, 0.16.0 the token mean (PR #2881)
        "loss_type": {"0.15.2": "grpo", "0.16.0": "bnpo"},
        "fails_at": "token_logps",
    },
    "pads-attended": {
        "reference": "huggingface/trl PR #2708",
        "bug": "the log-probs are computed without the attention mask: the prompts' left pads are attended (and the "
               "positions count them), so every row shorter than the longest prompt has the wrong log-probs",
        "pins": [entry("0.14.0", T451, "buggy"), entry("0.15.0", T451, "fixed")],
        # temperature 1: both releases take the log-probs at temperature 1 (PR #3029 came in 0.16.0)
        "settings": dict(loss_type="grpo", scale_rewards=True, beta=0.04, temperature=1.0,
                         per_device_train_batch_size=4, gradient_accumulation_steps=1, reward_weights=[1.0, 1.0]),
        # 0.14.0 has no hook for its advantages or log-probs (all inside compute_loss): its gradients are judged,
        # and the buggy pin runs a second time with the mask its pads give handed to the model (the diagnosis)
        "fails_at": "gradient",
        "diagnose": "mask_from_pads",
    },
}


def first_failure(r):
    """The first stage (in the step's order) outside the fixed pin's bounds, and its error; None when all agree."""
    if r["advantages"] is not None and r["advantages"] > STAGE_RTOL:  # None: a stage the release has no hook for
        return "advantages", r["advantages"]
    if r["completion_mask_mismatches"]:
        return "completion_mask", float(r["completion_mask_mismatches"])
    if r["token_logps"] is not None and r["token_logps"] > STAGE_RTOL:
        return "token_logps", r["token_logps"]
    if r["optimizer_steps"] != r["case_steps"]:
        return "optimizer steps", float(r["optimizer_steps"])
    for g in r["gradients"]:
        if g["error"] > AGREE:
            return f"step {g['step']} gradient {g['worst_tensor']}", g["error"]
    return None


def relative(a, b):
    import torch
    return float((a - b).abs().max() / b.abs().max().clamp(min=torch.finfo(torch.float64).tiny))


def compare(record, steps, ours):
    """Every stage as numbers: TRL's advantages and generation-time log-probs (relative max errors), its completion
    mask (mismatches), each step's gradient (normwise, per tensor); None for a stage the release gives no hook for."""
    import torch
    sys.path.insert(0, str(ROOT / "tests" / "oracle"))
    from parity_metrics import normwise_error

    rows = torch.tensor(record.rows)
    adv = mask_mismatch = logps = None
    if record.advantages is not None:
        adv = relative(record.advantages, ours["advantages"][rows])
        mask_ours = ours["completion_mask"][rows][:, :record.completion_mask.shape[1]]
        mask_mismatch = int((record.completion_mask.to(mask_ours.dtype) != mask_ours).sum())
        lp_ours = ours["token_logps"][rows][:, :record.token_logps.shape[1]]
        where = mask_ours.bool()
        logps = relative(record.token_logps[where], lp_ours[where])
    gradients = []
    for k, grads in enumerate(record.gradients, start=1):
        errors = {n: (normwise_error(g, ours[f"step{k}/{n}"]) if f"step{k}/{n}" in ours else float("inf"))
                  for n, g in grads.items()}
        worst = max(errors, key=errors.get)
        gradients.append({"step": k, "worst_tensor": worst, "error": errors[worst]})
    return {"advantages": adv, "completion_mask_mismatches": mask_mismatch, "token_logps": logps,
            "gradients": gradients, "optimizer_steps": len(record.gradients), "case_steps": steps}


def run_case(binary, model_dir, settings, work, hooks=None):
    """The case's settings through this venv's TRL (the survey's driver) and through the oracle: the comparison."""
    import dataclasses
    import torch
    import transformers
    import trl
    sys.path.insert(0, str(ROOT / "tests" / "oracle"))
    sys.path.insert(0, str(ROOT / "verify" / "conform"))
    import rl_step_parity as parity  # its case (prompts, completions, rewards) and RMSNorm patch
    from safetensors.torch import load_file
    from streambp_conform import rl, trl_grpo

    parity.patch_rms_norms()
    work.mkdir(parents=True)
    case = parity.base_case(settings)
    record = trl_grpo.train(case, model_dir, layout="trl", hooks=hooks)
    case_file, out = work / "case.json", work / "oracle.safetensors"
    case_file.write_text(json.dumps(rl.with_micro_batches(case, record).to_json()))
    p = subprocess.run([str(binary), "rl-step", "--load", str(model_dir), "--case", str(case_file), "--out", str(out),
                        "--force"], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"streambp rl-step: exit {p.returncode}\n{p.stdout}{p.stderr}")
    result = compare(record, trl_grpo.optimizer_steps(case), load_file(str(out)))
    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    declared = {k: v for k, v in settings.items() if k not in fields and k not in trl_grpo.ORACLE_ONLY}
    result.update(trl=trl.__version__, transformers=transformers.__version__, torch=torch.__version__,
                  declared=declared, settings=case.settings)
    return result


def pads_mask(args, kwargs):
    """The diagnosis of PR #2708: a model call without an attention mask handed the one its pad tokens give."""
    if kwargs.get("attention_mask") is None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        kwargs = dict(kwargs, attention_mask=(ids != PARITY_PAD).long())
    return kwargs


PARITY_PAD = 0  # tests/oracle/rl_step_parity.py's pad token


def inner(bug, version, binary, model_dir):
    sys.path.insert(0, str(ROOT / "verify" / "conform"))
    from streambp_conform import trl_grpo

    spec = BUGS[bug]
    settings = dict(spec["settings"])
    if "loss_type" in spec:
        settings["loss_type"] = spec["loss_type"][version]
    with tempfile.TemporaryDirectory() as work:
        result = run_case(binary, model_dir, settings, Path(work) / "run")
        if spec.get("diagnose") == "mask_from_pads" and version == spec["pins"][0]["requirements"][0].split("==")[1]:
            diagnosis = run_case(binary, model_dir, settings, Path(work) / "diagnosis",
                                 trl_grpo.Hooks(model_call=pads_mask))
            result["diagnosis"] = {"what": "the same run, the model handed the attention mask of its pad tokens",
                                   "gradients": diagnosis["gradients"]}
        pins.emit(result)


def run_pin(pin, bug, binary, model_dir):
    python = pins.survey.venv_python(pin)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore")
    version = pin["requirements"][0].split("==")[1]
    done = subprocess.run([python, __file__, "--inner", bug, version, str(binary), str(model_dir)],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{pin['name']}: the inner run failed (exit {done.returncode}):\n{tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def describe(r):
    grads = ", ".join(f"step {g['step']} {g['error']:.2e} ({g['worst_tensor']})" for g in r["gradients"])
    declared = f"; declared (no option at this pin): {r['declared']}" if r["declared"] else ""

    def num(x, fmt):
        return "not hooked" if x is None else format(x, fmt)
    mask = r["completion_mask_mismatches"]
    return (f"advantages {num(r['advantages'], '.1e')}, completion_mask "
            f"{'not hooked' if mask is None else f'{mask} mismatches'}, token_logps {num(r['token_logps'], '.1e')}, {r['optimizer_steps']} optimizer step(s): "
            f"{grads}{declared}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bug", nargs="*", choices=sorted(BUGS), default=sorted(BUGS))
    ap.add_argument("--binary", default=str(ROOT / "build" / "streambp"))
    a = ap.parse_args()
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        p = subprocess.run([a.binary, "run", "--preset", "tiny", "--method", "standard", "--seq", "8", "--seed", "5",
                            "--dtype", "fp64", "--save-model", str(model_dir)], capture_output=True, text=True)
        if p.returncode != 0:
            print(f"streambp run: exit {p.returncode}\n{p.stdout}{p.stderr}", file=sys.stderr)
            return 2
        for bug in a.bug:
            spec = BUGS[bug]
            print(f"{bug} ({spec['reference']}): {spec['bug']}")
            for pin in spec["pins"]:
                r = run_pin(pin, bug, a.binary, model_dir)
                failure = first_failure(r)
                if pin["tag"] == "buggy":
                    good = failure is not None and spec["fails_at"] in failure[0] and failure[1] > DIFFER
                else:
                    good = failure is None
                ok &= good
                verdict = f"FAILS at {failure[0]}: {failure[1]:.3e}" if failure else "passes"
                print(f"  {pin['tag']} trl {r['trl']} (transformers {r['transformers']}, torch {r['torch']}, "
                      f"{r['settings']['loss_type']}): {verdict} [{'as expected' if good else 'NOT as expected'}]\n"
                      f"    {describe(r)}")
                if "diagnosis" in r:
                    g = max(r["diagnosis"]["gradients"], key=lambda g: g["error"])
                    print(f"    diagnosis, {r['diagnosis']['what']}: largest gradient error {g['error']:.2e} "
                          f"(step {g['step']} {g['worst_tensor']})")
    print("recalled: every buggy pin fails where its bug acts, every fixed pin passes" if ok else "NOT recalled")
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--inner"]:
        inner(*sys.argv[2:6])
    else:
        sys.exit(main())
