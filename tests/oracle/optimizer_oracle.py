"""Our optimizer is torch's, bit for bit: AdamW and SGD (core/training/optimizer.h) after 10 steps equal torch.optim.AdamW and
torch.optim.SGD of torch 2.14.1 on CPU exactly (every parameter and every state tensor, fp64, fp32, bf16 and a mix
of the three), with torch.nn.utils.clip_grad_norm_ before each step (its returned norm equal too) and the lr of
transformers' get_cosine_schedule_with_warmup / get_constant_schedule_with_warmup through LambdaLR (equal lr values).
The weight-decay groups of decay_norms_and_biases=0 are HF Trainer's own (Trainer.get_decay_parameter_names on a
module tree with the same parameter names). Some runs save the state mid-run and resume from the file in a fresh
optimizer; one parameter misses its gradient at some steps (torch skips it and its step count).

Negative controls: the probe with beta2 = 0.99 instead of torch's 0.999, and with weight decay on every tensor
instead of HF's groups, must differ from torch.

Usage: python tests/oracle/optimizer_oracle.py BUILD/optimizer_probe
Exit code 0 pass, 1 fail (also when torch is missing: an oracle that cannot run is not a pass).
"""
# ctest-binary: optimizer_probe
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import torch
    from torch import nn
except ImportError as e:  # an oracle that cannot run fails: a CI without its oracles is not green
    print(f"FAIL: missing oracle dependency: {e} (make installs torch into the venv)")
    sys.exit(1)
from safetensors.torch import load_file, save_file
from transformers import Trainer, get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

THREADS = 2  # both sides: a reduction's order (the norms) depends on the thread count
STEPS = 10
# HF names, so that the decay groups are HF's. 257 x 300 = 77100 elements: above ATen's grain size (32768), so the
# norms run on both threads; odd sizes leave vector tails.
SHAPES = [
    ("model.embed_tokens.weight", (257, 300)),
    ("model.layers.0.input_layernorm.weight", (64,)),
    ("model.layers.0.self_attn.q_proj.weight", (64, 65)),
    ("model.layers.0.self_attn.q_proj.bias", (64,)),
    ("model.layers.0.self_attn.q_norm.weight", (16,)),
    ("model.layers.0.mlp.down_proj.weight", (33, 31)),
    ("model.norm.weight", (64,)),
    ("lm_head.weight", (7, 3)),
]
# (parameter, step) pairs without a gradient: torch skips the tensor (and its step count, and lazily makes its state
# only at its first gradient: lm_head at step 1).
NO_GRAD = {("model.layers.0.self_attn.q_proj.bias", 3), ("model.layers.0.self_attn.q_proj.bias", 4),
           ("lm_head.weight", 0)}
# Gradient scales per step: the total norm is about 290 x scale, so max_norm = 1 clips some steps and not others.
SCALES = [0.001, 0.01, 0.002, 0.02, 0.0005, 0.005, 0.03, 0.001, 0.008, 0.0002]
FAILURES = []


def fail(msg):
    FAILURES.append(msg)
    print("FAIL:", msg)


def make_case(dtypes, seed):
    """Initial parameters and per-step gradients, drawn in fp64 and rounded to each tensor's dtype."""
    g = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s, generator=g, dtype=torch.float64).to(dtypes[n]) for n, s in SHAPES}
    grads = []
    for k in range(STEPS):
        grads.append({n: (torch.randn(s, generator=g, dtype=torch.float64) * SCALES[k]).to(dtypes[n])
                      for n, s in SHAPES if (n, k) not in NO_GRAD})
    return params, grads


def hf_decay_names():
    """Trainer.get_decay_parameter_names on a module tree with our parameter names (it reads names and types only)."""
    root = nn.Module()
    for name, _ in SHAPES:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(torch.zeros(1)))
    return set(Trainer.get_decay_parameter_names(None, root))


def parse_spec(spec):
    kind, _, rest = spec.partition(":")
    return kind, {k: float(v) for k, v in (item.split("=") for item in rest.split(",") if item)}


def torch_run(run, params0, grads):
    """torch.optim + clip_grad_norm_ + transformers' schedule: final parameters, states, lrs and norms."""
    torch.set_num_threads(THREADS)
    kind, o = parse_spec(run["optimizer"])
    params = {n: nn.Parameter(params0[n].clone()) for n, _ in SHAPES}
    order = [params[n] for n, _ in SHAPES]
    wd = o.get("weight_decay", 0.0)
    if o.get("decay_norms_and_biases", 1.0) == 0.0:
        decay = hf_decay_names()
        groups = [{"params": [params[n] for n, _ in SHAPES if n in decay], "weight_decay": wd},
                  {"params": [params[n] for n, _ in SHAPES if n not in decay], "weight_decay": 0.0}]
    else:
        groups = [{"params": order, "weight_decay": wd}]
    if kind == "adamw":
        opt = torch.optim.AdamW(groups, lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"], weight_decay=wd)
    else:
        opt = torch.optim.SGD(groups, lr=o["lr"], momentum=o["momentum"], weight_decay=wd)
    schedule, _, warmup = run["schedule"].partition(",warmup=")
    warmup = int(warmup or 0)
    if schedule == "cosine":
        sched = get_cosine_schedule_with_warmup(opt, warmup, run["total_steps"])
    else:
        sched = get_constant_schedule_with_warmup(opt, warmup)
    lrs, norms = [], []
    for k in range(STEPS):
        for n, p in params.items():
            p.grad = grads[k][n].clone() if n in grads[k] else None
        norms.append(float(torch.nn.utils.clip_grad_norm_(order, run["max_norm"])) if run["max_norm"] else 0.0)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    states = {}
    for n, p in params.items():
        for key, value in opt.state[p].items():
            states[f"{n}.{key}"] = value
    return {n: p.detach() for n, p in params.items()}, states, lrs, norms


def probe_run(probe, run, params0, grads, folder, spec=None):
    tensors = {f"param/{n}": t for n, t in params0.items()}
    for k, step in enumerate(grads):
        tensors.update({f"grad/{k}/{n}": t for n, t in step.items()})
    metadata = {"param_names": ",".join(n for n, _ in SHAPES), "optimizer": spec or run["optimizer"],
                "state_dtype": "param", "schedule": run["schedule"], "steps": str(STEPS),
                "total_steps": str(run["total_steps"]), "max_norm": str(run["max_norm"] or "none"),
                "threads": str(THREADS)}
    if run.get("resume_at") is not None:
        metadata["resume_at"] = str(run["resume_at"])
    inp, out = Path(folder) / "in.safetensors", Path(folder) / "out.safetensors"
    save_file(tensors, str(inp), metadata=metadata)
    p = subprocess.run([probe, str(inp), str(out)], capture_output=True, text=True)
    if p.returncode != 0:
        fail(f"{run['name']}: probe exited {p.returncode}: {p.stdout}{p.stderr}")
        return None
    return load_file(str(out))


def differences(run, ours, theirs):
    """Every mismatch (dtype or any bit) between the probe's output and torch's, and the worst |difference|."""
    params, states, lrs, norms = theirs
    problems, worst = [], (0.0, "-")
    pairs = [(f"param/{n}", t) for n, t in params.items()]
    for name, t in states.items():
        if name.endswith(".step"):  # torch: float32 tensor; ours int64
            t = t.to(torch.int64)
        pairs.append((f"state/{name}", t))
    pairs.append(("state/step", torch.tensor(STEPS, dtype=torch.int64)))
    pairs += [(f"lr/{k}", torch.tensor(v, dtype=torch.float64)) for k, v in enumerate(lrs)]
    pairs += [(f"norm/{k}", torch.tensor(v, dtype=torch.float64)) for k, v in enumerate(norms)]
    expected = {name for name, _ in pairs}
    for name in ours:
        if name not in expected and not (name.endswith(".step") and name.startswith("state/")):
            problems.append(f"{name}: ours only")
    for name, t in pairs:
        if name not in ours:
            problems.append(f"{name}: missing from the probe's output")
            continue
        mine = ours[name]
        if mine.dtype != t.dtype or mine.shape != t.shape:
            problems.append(f"{name}: {mine.dtype}{list(mine.shape)} vs torch {t.dtype}{list(t.shape)}")
            continue
        if not torch.equal(mine, t):
            d = (mine.double() - t.double()).abs()
            bad = int((mine != t).sum())
            problems.append(f"{name}: {bad} of {t.numel()} elements differ, max |diff| {d.max().item():.3e}")
            if d.max().item() > worst[0]:
                worst = (d.max().item(), name)
    return problems, worst


RUNS = []
ADAMW = "adamw:lr=1e-2,beta1=0.9,beta2=0.999,eps=1e-8,weight_decay=0.01,decay_norms_and_biases=0"
SGD = "sgd:lr=0.1,momentum=0.9,weight_decay=0.01"
for dtype in (torch.float64, torch.float32, torch.bfloat16):
    name = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    RUNS.append({"name": f"adamw {name}, HF decay groups, cosine warmup=3, clip 1, resumed at 5",
                 "dtypes": {n: dtype for n, _ in SHAPES}, "optimizer": ADAMW, "schedule": "cosine,warmup=3",
                 "total_steps": STEPS, "max_norm": 1.0, "resume_at": 5})
    RUNS.append({"name": f"sgd {name}, momentum, constant warmup=2, clip 1, resumed at 4",
                 "dtypes": {n: dtype for n, _ in SHAPES}, "optimizer": SGD, "schedule": "constant,warmup=2",
                 "total_steps": STEPS, "max_norm": 1.0, "resume_at": 4})
MIXED = {n: (torch.float64, torch.float32, torch.bfloat16)[i % 3] for i, (n, _) in enumerate(SHAPES)}
RUNS.append({"name": "adamw fp64+fp32+bf16 tensors, decay all, cosine over 12, clip 0.5", "dtypes": MIXED,
             "optimizer": "adamw:lr=3e-3,beta1=0.8,beta2=0.99,eps=1e-6,weight_decay=0.1,decay_norms_and_biases=1",
             "schedule": "cosine", "total_steps": 12, "max_norm": 0.5})
RUNS.append({"name": "sgd fp64+fp32+bf16 tensors, no momentum, no decay, constant, no clip", "dtypes": MIXED,
             "optimizer": "sgd:lr=0.05,momentum=0,weight_decay=0,decay_norms_and_biases=1",
             "schedule": "constant", "total_steps": STEPS, "max_norm": None})
RUNS.append({"name": "adamw bf16, no decay, constant, no clip", "dtypes": {n: torch.bfloat16 for n, _ in SHAPES},
             "optimizer": "adamw:lr=1e-2,beta1=0.9,beta2=0.999,eps=1e-8,weight_decay=0,decay_norms_and_biases=1",
             "schedule": "constant", "total_steps": STEPS, "max_norm": None})
for i, run in enumerate(RUNS):
    run["seed"] = 100 + i


def main():
    probe = sys.argv[1]
    print(f"torch {torch.__version__}, {THREADS} threads, {STEPS} steps")
    with tempfile.TemporaryDirectory(prefix="sbp_optimizer_oracle_") as folder:
        for run in RUNS:
            params0, grads = make_case(run["dtypes"], run["seed"])
            theirs = torch_run(run, params0, grads)
            ours = probe_run(probe, run, params0, grads, folder)
            if ours is None:
                continue
            problems, worst = differences(run, ours, theirs)
            clipped = sum(1 for n in theirs[3] if run["max_norm"] and n > run["max_norm"])
            status = "bitwise equal" if not problems else f"{len(problems)} mismatches"
            print(f"{run['name']}: {status} ({len(theirs[0])} params, {len(theirs[1])} state tensors, "
                  f"{clipped} of {STEPS} steps clipped; worst |diff| {worst[0]:.3e} in {worst[1]})")
            for p in problems:
                fail(f"{run['name']}: {p}")

        # Negative controls: a wrong beta2, and decay on norms and biases where HF's groups exclude them.
        controls = [(RUNS[2], ADAMW.replace("beta2=0.999", "beta2=0.99"), "beta2 0.99 instead of 0.999"),
                    (RUNS[2], ADAMW.replace("decay_norms_and_biases=0", "decay_norms_and_biases=1"),
                     "weight decay on norms and biases")]
        for run, spec, what in controls:
            params0, grads = make_case(run["dtypes"], run["seed"])
            theirs = torch_run(run, params0, grads)
            ours = probe_run(probe, run, params0, grads, folder, spec=spec)
            if ours is None:
                continue
            problems, worst = differences(run, ours, theirs)
            if problems:
                print(f"negative control ({what}): differs as it must, worst |diff| {worst[0]:.3e} in {worst[1]}")
            else:
                fail(f"negative control ({what}) equals torch: the comparison cannot see a wrong update")
    if FAILURES:
        print(f"{len(FAILURES)} failures")
        return 1
    print("PASS: our AdamW, SGD, clip_grad_norm and lr schedules equal torch's and transformers' bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
