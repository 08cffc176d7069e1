"""Our LoRA is PEFT's LoRA: with the base and adapter `streambp run --lora ... --save-model --save-adapter` writes, HF
Transformers' Qwen3 wrapped by PEFT (`PeftModel.from_pretrained`) gives our loss (1e-12 relative) and our adapter
gradients (normwise max|ours - PEFT| / max|PEFT| <= 1e-10 per tensor) on the saved batch, in fp64, for SFT, GRPO
(beta > 0: the reference is the base with adapters disabled; token and sequence importance) and DPO, with every
projection adapted (all-linear) and with a subset, through standard, checkpoint, StreamBP (small chunks) and MsT.
The other direction too: an adapter made and saved by PEFT itself (init_lora_weights=False, so B != 0) loads into
our binary (--load BASE --adapter DIR) and gives PEFT's loss and gradients.

The GRPO and DPO losses below are TRL's (GRPOTrainer._compute_loss, DPOTrainer's sigmoid loss) on the batch tensors
of docs/objectives.md: position t predicts token t + 1, so the log-prob of token t is
log_softmax(logits[t - 1] / temperature)[input_ids[t]], read where completion_mask[t] = 1.
The reference log-probs our binary stored in the batch (base model, adapters disabled) are checked against PEFT's
`with model.disable_adapter():` pass, and one rerun per GRPO/DPO case drops them from the batch file so that the
binary recomputes them from a *loaded* adapter.

Usage: python tests/oracle/lora_parity.py BUILD/streambp
RMSNorm is patched as in tests/oracle/hf_parity.py (fp64 stays fp64; docs/departures-from-hf.md).
"""
# ctest-fault: lora_parity_fault STREAMBP_PARITY_FAULT=1e-6 FAIL: .*(normwise relative error|gradient error|of the allowance)
# ctest-cost: 25
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

try:
    import torch
    import transformers
    import peft
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file, save_file
except ImportError as e:  # an oracle that cannot run fails: a CI without its oracles is not green
    print(f"FAIL: missing oracle dependency: {e} (make installs transformers and peft into the venv)")
    sys.exit(1)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from hf_parity import patch_rms_norms  # noqa: E402  (the one RMSNorm patch, shared)
from parity_metrics import finite, normwise_error, stop_if_fault_run, with_fault  # noqa: E402

GRAD_RTOL = 1e-10
LOSS_RTOL = 1e-12
REF_RTOL = 1e-12
FAILURES = []

STREAMBP = "streambp:layer_chunk=5,head_chunk=4"
MST = "mst:mini_seq=3"


def fail(msg):
    FAILURES.append(msg)
    print("FAIL:", msg)
    stop_if_fault_run()


def run(binary, args, what):
    p = subprocess.run([binary, "run", *map(str, args)], capture_output=True, text=True)
    if p.returncode != 0:
        fail(f"{what}: streambp run exited {p.returncode}\n{p.stdout}{p.stderr}")
        return False
    return True


# ------------------------------------------------------------------------------------------------ the oracle

def load_peft(model_dir, adapter_dir):
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="sdpa")
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    return model


def peft_name(n):  # named_parameters() carries the adapter name; files and our gradients do not
    return n.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def check_loaded_adapter(model, adapter_dir, what):
    """PEFT warns (does not fail) on missing/unexpected keys: check that every file tensor went in, in fp64."""
    saved = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    trainable = {peft_name(n): p for n, p in model.named_parameters() if p.requires_grad}
    if set(saved) != set(trainable):
        fail(f"{what}: adapter file vs PEFT's trainable parameters differ: {sorted(set(saved) ^ set(trainable))[:6]}")
    for n, p in trainable.items():
        if p.dtype != torch.float64:
            fail(f"{what}: PEFT holds {n} in {p.dtype}")
        if n in saved and not torch.equal(saved[n].to(p.dtype), p.detach()):
            fail(f"{what}: {n} as loaded by PEFT differs from the file")
    if not any(n.endswith("lora_B.weight") and t.abs().max() > 0 for n, t in saved.items()):
        fail(f"{what}: every lora_B is zero: the adapter is a no-op and the check proves nothing")
    return trainable


def token_logps(logits, input_ids, temperature):
    """[B, T-1]: entry t-1 is the log-prob of token t (t = 1..T-1), TRL's selective_log_softmax."""
    logp = torch.log_softmax(logits[:, :-1].to(torch.float64) / temperature, dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def sft_loss(logits, b):
    shifted = torch.nn.functional.pad(b["labels"], (0, 1), value=-100)[:, 1:]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)


def grpo_loss(logits, b, o):
    """TRL GRPOTrainer._compute_loss on one process, num_iterations as given by old_logps."""
    temp = o.get("temperature", 1.0)
    logps = token_logps(logits, b["input_ids"], temp)
    mask = b["completion_mask"][:, 1:].to(torch.float64)
    old = b["old_logps"][:, 1:] if "old_logps" in b else logps.detach()
    log_ratio = logps - old
    if o.get("importance", "token") == "token":
        log_w = log_ratio
    else:  # importance_sampling_level="sequence"
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    coef_2 = torch.clamp(coef_1, 1 - o.get("epsilon_low", 0.2), 1 + o.get("epsilon_high", 0.2))
    adv = b["advantages"].unsqueeze(1)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    beta = o.get("beta", 0.0)
    if beta != 0.0:
        ref = b["ref_logps"][:, 1:]
        per_token_kl = torch.exp(ref - logps) - (ref - logps) - 1
        if o.get("kl", "k3") == "k3_ratio":  # TRL's use_bias_correction_kl: times the importance ratio
            per_token_kl = per_token_kl * coef_1
        per_token = per_token + beta * per_token_kl
    loss_type = o.get("loss_type", "dapo")
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo"):  # dapo: the generation batch's token count = this batch's, one process
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * o.get("max_completion_length", 256))
    raise ValueError(loss_type)


def completion_sums(logits, b):
    return (token_logps(logits, b["input_ids"], 1.0) * b["completion_mask"][:, 1:].to(torch.float64)).sum(-1)


def dpo_loss(logits, b, o):
    """TRL DPOTrainer, loss_type="sigmoid": rows 0..P-1 chosen, P..2P-1 rejected."""
    beta, ls = o.get("beta", 0.1), o.get("label_smoothing", 0.0)
    s = completion_sums(logits, b)
    P = s.size(0) // 2
    ref = b["ref_logps"]
    z = beta * ((s[:P] - ref[:P]) - (s[P:] - ref[P:]))
    return (-torch.nn.functional.logsigmoid(z) * (1 - ls) - torch.nn.functional.logsigmoid(-z) * ls).mean()


def parse_objective(spec):
    name, _, rest = spec.partition(":")
    opts = {}
    for kv in filter(None, rest.split(",")):
        k, v = kv.split("=")
        try:
            opts[k] = float(v) if k != "max_completion_length" else int(v)
        except ValueError:
            opts[k] = v
    return name, opts


def reference_logps(model, b, name, opts):
    """The reference our binary must have used under LoRA: the base, adapters disabled (TRL's PEFT path)."""
    with torch.no_grad(), model.disable_adapter():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    if name == "grpo":  # [B, T], log-prob of token t where completion_mask = 1, else 0
        lp = token_logps(logits, b["input_ids"], opts.get("temperature", 1.0))
        return torch.nn.functional.pad(lp, (1, 0)) * b["completion_mask"].to(torch.float64)
    return completion_sums(logits, b)  # dpo: [2P]


def oracle(model_dir, adapter_dir, batch_file, objective, what):
    """PEFT's loss and adapter gradients (PEFT names) on our batch; None if the adapter did not load faithfully."""
    model = load_peft(model_dir, adapter_dir)
    trainable = check_loaded_adapter(model, adapter_dir, what)
    b = load_file(str(batch_file))
    name, opts = parse_objective(objective)
    if name in ("grpo", "dpo") and "ref_logps" in b:
        ours_ref = b["ref_logps"]
        ref = reference_logps(model, b, name, opts)
        err = ((ours_ref - ref).abs().max() / ref.abs().max()).item()
        print(f"  {what}: stored ref_logps vs PEFT disable_adapter(): normwise error {err:.2e}")
        if not err <= REF_RTOL:
            fail(f"{what}: ref_logps in our batch are not the base model's (adapters disabled): normwise error {err:.3e}")
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    loss = {"sft": lambda: sft_loss(logits, b), "grpo": lambda: grpo_loss(logits, b, opts),
            "dpo": lambda: dpo_loss(logits, b, opts)}[name]()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainable.items()}
    if any(g is None for g in grads.values()):
        fail(f"{what}: PEFT left some adapter gradient empty")
    with torch.no_grad(), model.disable_adapter():  # control: the adapter must move the loss
        base_logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        moved = (base_logits - logits.detach()).abs().max().item()
    if not moved > 1e-6:
        fail(f"{what}: the adapter changes the logits by only {moved:.1e}: no test")
    return loss.item(), grads


def compare(what, ours_json, ours_grads, hf_loss, hf_grads):
    if not (Path(ours_json).exists() and Path(ours_grads).exists()):
        return  # the run already failed
    ours_loss = json.loads(Path(ours_json).read_text())["loss"]
    ours = with_fault(load_file(str(ours_grads)))
    problems = []
    if set(ours) != set(hf_grads):
        problems.append(f"gradient names differ: {sorted(set(ours) ^ set(hf_grads))[:6]}")
    worst, worst_name = 0.0, ""
    for n, g in hf_grads.items():
        if n not in ours:
            continue
        err = normwise_error(ours[n], g)
        if not err <= GRAD_RTOL:
            problems.append(f"{n}: normwise relative error {err:.3e}")
        if not err <= worst:
            worst, worst_name = err, n
    loss_err = finite(abs(ours_loss - hf_loss) / abs(hf_loss))
    if not loss_err <= LOSS_RTOL:
        problems.append(f"loss {ours_loss!r} vs PEFT {hf_loss!r} (relative {loss_err:.2e})")
    status = "FAIL" if problems else "ok"
    print(f"{status}: {what}: loss {ours_loss:.15g} (PEFT {hf_loss:.15g}, rel {loss_err:.1e}), largest gradient error "
          f"{worst:.2e} over {len(hf_grads)} adapter tensors")
    for p in problems:
        fail(f"{what}: {p}")


# ------------------------------------------------------------------------------------------------ the cases

CASES = [
    # name, objective, targets, random-batch args, generating method, rerun methods
    ("sft", "sft", "all-linear", ["--batch", "3", "--seq", "23", "--pad-fraction", "0.3", "--prompt-fraction", "0.2"],
     "standard", ["checkpoint", STREAMBP, MST]),
    ("sft-subset", "sft", "q,v,down", ["--batch", "2", "--seq", "19", "--pad-fraction", "0.2"],
     STREAMBP, ["standard", MST]),
    ("grpo-token", "grpo:beta=0.04,loss_type=bnpo,temperature=0.9", "all-linear",
     ["--batch", "4", "--group", "2", "--seq", "21", "--pad-fraction", "0.3"], "standard", [STREAMBP, MST]),
    ("grpo-sequence", "grpo:beta=0.1,importance=sequence,loss_type=grpo", "k,o,gate,up",
     ["--batch", "4", "--group", "2", "--seq", "18", "--pad-fraction", "0.25"], STREAMBP, ["standard", MST]),
    ("dpo", "dpo:beta=0.2,label_smoothing=0.1", "all-linear", ["--batch", "4", "--seq", "20", "--pad-fraction", "0.3"],
     "standard", [STREAMBP, MST]),
    ("dpo-subset", "dpo", "q,k,v", ["--batch", "2", "--seq", "17", "--pad-fraction", "0.2"], MST, ["standard", STREAMBP]),
]


def ours_case(binary, work, i, name, objective, targets, random_args, first, reruns):
    d = work / name
    d.mkdir()
    model_dir, adapter_dir, batch = d / "model", d / "adapter", d / "batch.safetensors"
    common = ["--objective", objective, "--dtype", "fp64"]
    runs = []  # (label, json, grads)
    label = f"{name} [{targets}] {first}"
    if run(binary, ["--preset", "tiny", "--seed", 20 + i, *random_args, "--method", first, *common,
                    "--lora", f"rank={3 + i % 3},alpha={5 + 2 * i},targets={targets},init=random",
                    "--save-model", model_dir, "--save-adapter", adapter_dir, "--save-batch", batch,
                    "--save-grads", d / "g0.safetensors", "--json", d / "r0.json"], label):
        runs.append((label, d / "r0.json", d / "g0.safetensors"))
    else:
        return None
    load = ["--load", model_dir, "--adapter", adapter_dir, *common]
    for k, m in enumerate(reruns, 1):
        label = f"{name} [{targets}] {m} (reloaded)"
        if run(binary, [*load, "--batch-file", batch, "--method", m, "--save-grads", d / f"g{k}.safetensors",
                        "--json", d / f"r{k}.json"], label):
            runs.append((label, d / f"r{k}.json", d / f"g{k}.safetensors"))
    if objective.startswith(("grpo", "dpo")):  # the binary's own base-as-reference pass, from a loaded adapter
        b = load_file(str(batch))
        b.pop("ref_logps")
        no_ref = d / "batch-no-ref.safetensors"
        save_file(b, str(no_ref))
        label = f"{name} [{targets}] {reruns[-1]} (reloaded, ref_logps recomputed by the binary)"
        if run(binary, [*load, "--batch-file", no_ref, "--method", reruns[-1], "--save-grads", d / "gr.safetensors",
                        "--json", d / "rr.json"], label):
            runs.append((label, d / "rr.json", d / "gr.safetensors"))
    return model_dir, adapter_dir, batch, runs


def peft_made_adapter(binary, work, model_dir, batch, objective, tag):
    """PEFT creates and saves the adapter; our binary loads it."""
    d = work / f"peft-made-{tag}"
    d.mkdir()
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="sdpa")
    torch.manual_seed(5)
    made = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    made.save_pretrained(d / "adapter")
    del made, base
    adapter_dir = d / "adapter"
    runs = []
    for k, m in enumerate(["standard", STREAMBP]):
        label = f"PEFT-made adapter, {objective} {m}"
        if run(binary, ["--load", model_dir, "--adapter", adapter_dir, "--objective", objective, "--dtype", "fp64",
                        "--batch-file", batch, "--method", m, "--save-grads", d / f"g{k}.safetensors",
                        "--json", d / f"r{k}.json"], label):
            runs.append((label, d / f"r{k}.json", d / f"g{k}.safetensors"))
    return adapter_dir, runs


def main():
    binary = sys.argv[1]
    start = time.time()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    patch_rms_norms()
    torch.manual_seed(0)
    print(f"transformers {transformers.__version__}, peft {peft.__version__}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        saved = {}
        for i, (name, objective, targets, random_args, first, reruns) in enumerate(CASES):
            made = ours_case(binary, work, i, name, objective, targets, random_args, first, reruns)
            if made is None:
                continue
            model_dir, adapter_dir, batch, runs = made
            saved[name] = (model_dir, batch)
            hf_loss, hf_grads = oracle(model_dir, adapter_dir, batch, objective, name)
            for label, record, grads in runs:
                compare(label, record, grads, hf_loss, hf_grads)
        for tag, objective in (("sft", "sft"), ("dpo", "dpo:beta=0.2,label_smoothing=0.1")):
            if tag not in saved:
                continue
            model_dir, batch = saved[tag]
            adapter_dir, runs = peft_made_adapter(binary, work, model_dir, batch, objective, tag)
            hf_loss, hf_grads = oracle(model_dir, adapter_dir, batch, objective, f"PEFT-made adapter ({tag})")
            for label, record, grads in runs:
                compare(label, record, grads, hf_loss, hf_grads)
    print(f"{'FAILED' if FAILURES else 'passed'}: {len(FAILURES)} failure(s), {time.time() - start:.1f} s")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
