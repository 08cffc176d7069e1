"""GRPO and DPO against oracles that are not us: Hugging Face transformers' own Qwen3 on our checkpoint and batch,
fp64, with the losses (1) written from TRL's formulas (tests/oracle/lora_parity.py: GRPOTrainer._compute_loss, DPOTrainer's
sigmoid loss) and (2) computed by TRL itself, the pinned release (tests/support/trl_oracle.py: TRL's trainer methods on the
same model and batch). Our loss must equal both (1e-12 relative) and every parameter gradient must equal both
(normwise <= 1e-10), through standard BP and StreamBP, for every GRPO loss_type, beta = 0 and beta > 0, token and
sequence importance, temperature != 1, with and without old_logps, the KL times the ratio (kl=k3_ratio, TRL's
use_bias_correction_kl), and DPO with and without label smoothing; TRL's
own loss and gradients must equal the formulas' at the same bounds. TRL's released fused LM head (fp32 inside) is run
too and must agree to fp32 rounding (FUSED_RTOL). With --ref, the reference log-probs our binary computed from a
reference checkpoint are checked against HF's forward of that checkpoint.

GRPO on packed rows (run --pack; docs/packing.md "GRPO on packed rows"): TRL has no packed GRPO loss, so its oracle
is what a packed batch means, the same completions one per right-padded row: the formulas and TRL run on those rows,
and our gradients on the packed batch must equal theirs at the same bounds (with --ref too: our reference pass on
packed rows against HF's forward of each completion alone).

Negative controls (CTest): STREAMBP_PARITY_FAULT scales one of our gradients (objective_parity_fault);
STREAMBP_TRL_FAULT scales TRL's loss (objective_parity_trl_fault): each must make the script fail.

Usage: python tests/oracle/objective_parity.py BUILD/streambp
"""
# ctest-fault: objective_parity_fault STREAMBP_PARITY_FAULT=1e-6 FAIL: .*(normwise relative error|gradient error|of the allowance)
# ctest-fault: objective_parity_trl_fault STREAMBP_TRL_FAULT=1e-6 FAIL: .*TRL \(fp64 head\) differs from the formulas
# ctest-cost: 36
import json
import math
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

try:
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
    import trl_oracle
except ImportError as e:  # an oracle that cannot run fails: a CI without its oracles is not green
    print(f"FAIL: missing oracle dependency: {e} (make installs transformers and trl into the venv)")
    sys.exit(1)

from hf_parity import patch_rms_norms  # noqa: E402
from parity_metrics import finite, normwise_error, stop_if_fault_run, with_fault  # noqa: E402
from lora_parity import dpo_loss, grpo_loss, parse_objective, token_logps, completion_sums  # noqa: E402

GRAD_RTOL, LOSS_RTOL, REF_RTOL = 1e-10, 1e-12, 1e-12
# TRL's fused LM head rounds every logit tile to fp32: measured against the fp64 formulas over these cases, loss
# <= 1.9e-6 relative (the smallest losses, 0.018, are differences of advantage terms) and gradients <= 5.2e-7
# normwise. A misplaced temperature, shift or mask moves them by > 1e-2.
FUSED_RTOL = 1e-4
STREAMBP = "streambp:layer_chunk=5,head_chunk=7"
FAILURES = []


def fail(msg):
    FAILURES.append(msg)
    print("FAIL:", msg)
    stop_if_fault_run()


def run(binary, args):
    p = subprocess.run([binary, "run", *map(str, args)], capture_output=True, text=True)
    if p.returncode != 0:
        fail(f"streambp run {' '.join(map(str, args))}: exit {p.returncode}\n{p.stdout}{p.stderr}")
    return p.returncode == 0


def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="sdpa")


def hf_reference(ref_dir, b, name, opts):
    """The reference model's own log-probs, in the batch file's layout (GRPO [B, T]; DPO [2P] sums)."""
    with torch.no_grad():
        logits = hf_model(ref_dir)(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    if name == "grpo":
        lp = token_logps(logits, b["input_ids"], opts.get("temperature", 1.0))
        return torch.nn.functional.pad(lp, (1, 0)) * b["completion_mask"].to(torch.float64)
    return completion_sums(logits, b)


def oracle(model_dir, batch, objective, ref_dir):
    name, opts = parse_objective(objective)
    b = dict(batch)
    if ref_dir:
        ours = b["ref_logps"]
        b["ref_logps"] = hf_reference(ref_dir, b, name, opts)
        err = ((ours - b["ref_logps"]).abs().max() / b["ref_logps"].abs().max()).item()
        print(f"  reference log-probs from {Path(ref_dir).name}: ours vs HF's forward of the reference, error {err:.1e}")
        if not err <= REF_RTOL:
            fail(f"{objective}: reference log-probs differ from HF's reference forward ({err:.3e})")
    model = hf_model(model_dir)
    model.train()  # TRL's training branch of its normalisers (Qwen3's attention dropout is 0: same forward)
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    loss = grpo_loss(logits, b, opts) if name == "grpo" else dpo_loss(logits, b, opts)
    loss.backward()
    formula = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    trl = {}
    for head in ("fp64", "fused"):  # tests/support/trl_oracle.py: the fp64 head is exact, the fused one fp32 inside
        model.zero_grad(set_to_none=True)
        trl_loss = (trl_oracle.grpo_loss if name == "grpo" else trl_oracle.dpo_loss)(model, b, opts, head)
        trl_loss.backward()
        trl[head] = (trl_loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    for head, rtol in (("fp64", GRAD_RTOL), ("fused", FUSED_RTOL)):
        loss_err, worst, worst_name = errors(trl[head][0], trl[head][1], *formula)
        loss_rtol = LOSS_RTOL if head == "fp64" else FUSED_RTOL
        ok = worst <= rtol and loss_err <= loss_rtol
        print(f"  {'ok' if ok else 'FAIL'}: TRL {trl_oracle.VERSION} ({head} head) vs the formulas: loss rel "
              f"{loss_err:.1e}, largest gradient error {worst:.2e} in {worst_name}")
        if not ok:
            fail(f"{objective}: TRL ({head} head) differs from the formulas: loss error {loss_err:.3e}, "
                 f"gradient error {worst:.3e} in {worst_name}")
    return formula, trl["fp64"]


def errors(loss, grads, ref_loss, ref_grads):
    """(relative loss error, largest normwise gradient error, its parameter) of (loss, grads) against the ref's."""
    worst, worst_name = 0.0, "-"
    for n, g in ref_grads.items():
        err = normwise_error(grads[n], g) if n in grads else math.inf
        if not err <= worst:
            worst, worst_name = err, n
    return finite(abs(loss - ref_loss) / abs(ref_loss)), worst, worst_name


def compare(what, record, grads_file, formula, trl):
    """Our loss and gradients against the formulas' and TRL's (each (loss, {name: gradient}) on HF's model)."""
    ours_loss = json.loads(Path(record).read_text())["loss"]
    ours = with_fault(load_file(str(grads_file)))
    if set(ours) != set(formula[1]):
        fail(f"{what}: parameter names differ: {sorted(set(ours) ^ set(formula[1]))[:4]}")
    loss_err, worst, worst_name = errors(ours_loss, ours, *formula)
    trl_loss_err, trl_worst, trl_worst_name = errors(ours_loss, ours, *trl)
    ok = worst <= GRAD_RTOL and loss_err <= LOSS_RTOL
    trl_ok = trl_worst <= GRAD_RTOL and trl_loss_err <= LOSS_RTOL
    print(f"{'ok' if ok and trl_ok else 'FAIL'}: {what}: loss {ours_loss:.15g} (HF formulas {formula[0]:.15g}, rel "
          f"{loss_err:.1e}; TRL rel {trl_loss_err:.1e}), largest gradient error {worst:.2e} in {worst_name} "
          f"(vs TRL {trl_worst:.2e})")
    if not ok:
        fail(f"{what}: loss error {loss_err:.3e}, gradient error {worst:.3e} in {worst_name}")
    if not trl_ok:
        fail(f"{what}: against TRL: loss error {trl_loss_err:.3e}, gradient error {trl_worst:.3e} in {trl_worst_name}")


def padded_completions(b):
    """A packed GRPO batch's sequences (cu_seqlens over the flattened rows) as right-padded rows, one each, padded to
    the longest: tokens 0, attention_mask, completion_mask and log-probs 0 on pads; advantages (one per sequence) as
    they are."""
    cu = b["cu_seqlens"].tolist()
    flat = {k: b[k].reshape(-1) for k in ("input_ids", "attention_mask", "completion_mask", "old_logps", "ref_logps")
            if k in b}
    longest = max(e - s for s, e in zip(cu, cu[1:]))
    out = {}
    for k, t in flat.items():
        rows = [torch.nn.functional.pad(t[s:e], (0, longest - (e - s))) for s, e in zip(cu, cu[1:])]
        out[k] = torch.stack(rows)
    out["advantages"] = b["advantages"]
    return out


def case(binary, work, i, objective, batch_args, ref_dir=None, drop_old=False):
    d = work / f"case{i}"
    d.mkdir()
    common = ["--dtype", "fp64", "--objective", objective]
    if not run(binary, ["--preset", "tiny", "--method", "standard", "--seed", 100 + i, *batch_args, *common,
                        *(["--ref", ref_dir] if ref_dir else []), "--save-model", d / "model",
                        "--save-batch", d / "batch.safetensors"]):
        return
    batch_file = d / "batch.safetensors"
    batch = load_file(str(batch_file))
    if drop_old:
        batch.pop("old_logps")
        batch_file = d / "batch-no-old.safetensors"
        save_file(batch, str(batch_file))
    packed = "cu_seqlens" in batch
    formula, trl = oracle(d / "model", padded_completions(batch) if packed else batch, objective, ref_dir)
    for method in ("standard", STREAMBP):
        tag = method.split(":")[0]
        if run(binary, ["--load", d / "model", "--batch-file", batch_file, "--method", method, *common,
                        "--save-grads", d / f"{tag}.safetensors", "--json", d / f"{tag}.json"]):
            what = (f"{objective}{' (no old_logps)' if drop_old else ''}{' (--ref)' if ref_dir else ''}"
                    f"{' (packed rows)' if packed else ''} {method}")
            compare(what, d / f"{tag}.json", d / f"{tag}.safetensors", formula, trl)


def main():
    binary = sys.argv[1]
    patch_rms_norms()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    print(f"transformers {transformers.__version__}, trl {trl_oracle.VERSION}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ref = work / "reference"  # another set of weights of the same architecture: the reference policy
        if not run(binary, ["--preset", "tiny", "--method", "standard", "--seq", "8", "--seed", "999", "--dtype", "fp64",
                            "--save-model", ref]):
            return 1
        grpo = ["--batch", "4", "--group", "2", "--seq", "26", "--pad-fraction", "0.3"]
        # Two rows of 26 packed with completions of 1..12 tokens (a ragged last one, some of one token: no completion).
        grpo_packed = ["--batch", "2", "--group", "2", "--seq", "26", "--pack", "uniform:min=1,max=12"]
        dpo1 = ["--batch", "2", "--seq", "24", "--pad-fraction", "0.3"]
        dpo2 = ["--batch", "4", "--seq", "21", "--pad-fraction", "0.3"]
        cases = [
            ("grpo:loss_type=grpo,beta=0", grpo, {}),
            ("grpo:loss_type=bnpo,beta=0.04,temperature=0.9", grpo, {}),
            ("grpo:loss_type=dr_grpo,beta=0.1,importance=sequence,temperature=0.7,max_completion_length=40", grpo, {}),
            ("grpo:loss_type=dapo,importance=sequence,epsilon_high=0.28", grpo, {}),
            ("grpo:loss_type=bnpo,beta=0.04,kl=k3_ratio,temperature=0.9", grpo, {}),
            ("grpo:loss_type=bnpo,beta=0.04", grpo, {"drop_old": True}),
            ("grpo:loss_type=grpo,beta=0.04,importance=sequence", grpo, {"drop_old": True}),
            ("grpo:loss_type=dapo,beta=0.04,temperature=1.3", grpo, {"ref_dir": ref}),
            ("grpo:loss_type=grpo,beta=0.04,importance=sequence", grpo_packed, {}),
            ("grpo:loss_type=dr_grpo,beta=0.1,temperature=0.9,max_completion_length=40", grpo_packed, {"ref_dir": ref}),
            ("dpo", dpo1, {}),
            ("dpo:beta=0.5,label_smoothing=0.1", dpo2, {}),
            ("dpo:beta=0.2", dpo2, {"ref_dir": ref}),
        ]
        for i, (objective, batch_args, extra) in enumerate(cases):
            case(binary, work, i, objective, batch_args, **extra)
    print(f"{'FAILED' if FAILURES else 'passed'}: {len(FAILURES)} failure(s)")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
