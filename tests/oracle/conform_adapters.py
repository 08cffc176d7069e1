"""The shipped conformance adapters (verify/conform/) do what `streambp conform` will judge them on: on case
directories of protocol streambp-conform/1 made from `streambp run --save-model/--save-batch/--save-adapter`,
hf_adapter.py (standard BP and --gradient-checkpointing) gives the binary's fp64 standard-BP loss (1e-12 relative)
and every trainable gradient (normwise max|ref - ours| / max|ref| <= 1e-10 per tensor, under HF/PEFT names), for SFT,
GRPO and DPO, full and LoRA, tied and untied; the negative control wrong_per_chunk.py fails the same judgement. In
fp32 and bf16 the adapter passes the harness's low-precision rule (verify/grad_compare.h low_precision_rule, judged by
`streambp compare --baseline`): per tensor, its l2 error against fp64 on the same weights is at most allowance(n) x the
binary's own standard BP error in that dtype plus the rounding floor.

Usage: python tests/oracle/conform_adapters.py BUILD/streambp [--all]
Default: a handful of cases (< 60 s on a shared 2-core machine); --all: the whole matrix below (every GRPO loss_type,
both importance levels, beta 0 and > 0, DPO label smoothing 0 and 0.1, presets and configs). One adapter run goes
through the command line exactly as the harness calls it; the others import the same entry point
(protocol.main) in this process, to pay Python's import of torch/transformers/peft once.
"""
# ctest-timeout: 600
# ctest-cost: 35
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    import torch
    import transformers  # noqa: F401
    import peft  # noqa: F401
    from safetensors.torch import load_file, save_file
except ImportError as e:  # an oracle that cannot run fails: a CI without its oracles is not green
    print(f"FAIL: missing oracle dependency: {e} (make installs transformers and peft into the venv)")
    sys.exit(1)

CONFORM = Path(__file__).resolve().parents[2] / "verify" / "conform"
sys.path.insert(0, str(CONFORM))
import losses  # noqa: E402
import protocol  # noqa: E402
import wrong_per_chunk  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # the oracles' shared helpers
from parity_metrics import low_precision_verdict  # noqa: E402

GRAD_RTOL, LOSS_RTOL = 1e-10, 1e-12
DEGENERATE = 1e-4  # `streambp compare`'s floor: a tensor with max|ref| below 1e-4 of the global max is judged against it
FAILURES = []

# An untied Qwen3 with q/k/v/o bias and as many K/V heads as query heads: the other branch of every HF switch.
UNTIED_BIAS_MHA = {"model_type": "qwen3", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8,
                   "tie_word_embeddings": False, "attention_bias": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
# No qk-norm: the harness writes it as HF's llama (core/model/config.cpp config_to_json).
LLAMA_UNTIED = {**UNTIED_BIAS_MHA, "model_type": "llama", "attention_bias": False, "num_key_value_heads": 2}
# No qk-norm, q/k/v bias but none on o_proj: written as HF's qwen2.
QWEN2_BIAS = {**UNTIED_BIAS_MHA, "model_type": "qwen2", "num_key_value_heads": 2, "tie_word_embeddings": True}

SFT_BATCH = ["--batch", "3", "--seq", "37", "--pad-fraction", "0.3", "--prompt-fraction", "0.2"]
GRPO_BATCH = ["--batch", "4", "--group", "2", "--seq", "26", "--pad-fraction", "0.3"]
DPO_BATCH = ["--batch", "4", "--seq", "21", "--pad-fraction", "0.3"]


def grpo(**o):
    return {"name": "grpo", "beta": 0.0, "epsilon": 0.2, "epsilon_high": None, "loss_type": "dapo",
            "importance_sampling_level": "token", "temperature": 1.0, "max_completion_length": None, **o}


def dpo(**o):
    return {"name": "dpo", "beta": 0.1, "label_smoothing": 0.0, "loss_type": "sigmoid", **o}


# name, model (preset or config dict), dtype, objective, LoRA spec or None, random-batch args, adapters, in default set
#   adapters: "hf", "hf-ckpt", "example" (judged: must pass), "wrong" (judged: must fail); "cli:..." through the
#   command line (example: CLI only, it is a script without an entry point)
CASES = [
    ("sft-tied", "tiny", "fp64", {"name": "sft"}, None, SFT_BATCH, ["cli:hf-ckpt", "cli:example", "hf", "wrong"], True),
    ("sft-lora-untied-bias-mha", UNTIED_BIAS_MHA, "fp64", {"name": "sft"}, "rank=4,alpha=8,init=random", SFT_BATCH,
     ["hf", "hf-ckpt", "wrong"], True),
    ("grpo-bnpo-beta-lora", "tiny", "fp64", grpo(beta=0.04, loss_type="bnpo", temperature=0.9),
     "rank=3,alpha=5,targets=q,v,down,init=random", GRPO_BATCH, ["hf-ckpt", "wrong"], True),
    ("grpo-dapo-sequence-untied", UNTIED_BIAS_MHA, "fp64", grpo(importance_sampling_level="sequence", epsilon_high=0.28),
     None, GRPO_BATCH, ["hf"], True),
    ("dpo-ls-tied", "tiny", "fp64", dpo(beta=0.5, label_smoothing=0.1), None, DPO_BATCH, ["hf", "wrong"], True),
    ("bf16-grpo-beta-lora", "tiny", "bf16", grpo(beta=0.04, loss_type="bnpo"), "rank=4,alpha=8,init=random",
     GRPO_BATCH, ["hf", "hf-ckpt"], True),
    # --all only
    ("sft-mha", "tiny-mha", "fp64", {"name": "sft"}, None, SFT_BATCH, ["hf", "hf-ckpt", "wrong"], False),
    ("sft-llama-untied", LLAMA_UNTIED, "fp64", {"name": "sft"}, None, SFT_BATCH, ["hf", "hf-ckpt"], False),
    ("dpo-lora-qwen2-bias", QWEN2_BIAS, "fp64", dpo(beta=0.3), "rank=2,alpha=4,init=random", DPO_BATCH,
     ["hf", "hf-ckpt", "wrong"], False),
    ("grpo-grpo-beta0", "tiny", "fp64", grpo(loss_type="grpo"), None, GRPO_BATCH, ["hf", "hf-ckpt", "wrong"], False),
    ("grpo-bnpo-beta", "tiny", "fp64", grpo(beta=0.04, loss_type="bnpo", temperature=0.9), None, GRPO_BATCH,
     ["hf", "wrong"], False),
    ("grpo-drgrpo-sequence-beta", "tiny", "fp64", grpo(beta=0.1, loss_type="dr_grpo", importance_sampling_level="sequence",
     temperature=0.7, max_completion_length=40), None, GRPO_BATCH, ["hf", "hf-ckpt", "wrong"], False),
    ("grpo-dapo-token-beta-no-old", "tiny", "fp64", grpo(beta=0.04), None, GRPO_BATCH + ["no-old"], ["hf"], False),
    ("grpo-grpo-sequence-beta-lora", UNTIED_BIAS_MHA, "fp64", grpo(beta=0.1, loss_type="grpo",
     importance_sampling_level="sequence"), "rank=4,alpha=6,targets=k,o,gate,up,init=random", GRPO_BATCH,
     ["hf", "hf-ckpt"], False),
    ("grpo-lora-ref-from-adapter", "tiny", "fp64", grpo(beta=0.04, loss_type="dr_grpo", max_completion_length=30),
     "rank=4,alpha=8,init=random", GRPO_BATCH + ["no-ref"], ["hf"], False),
    ("dpo-tied", "tiny", "fp64", dpo(), None, DPO_BATCH, ["hf", "hf-ckpt", "wrong"], False),
    ("dpo-ls-lora-untied", UNTIED_BIAS_MHA, "fp64", dpo(beta=0.2, label_smoothing=0.1), "rank=4,alpha=8,init=random",
     DPO_BATCH, ["hf", "hf-ckpt", "wrong"], False),
    ("dpo-lora-ref-from-adapter", "tiny", "fp64", dpo(beta=0.2), "rank=3,alpha=6,targets=q,k,v,init=random",
     DPO_BATCH + ["no-ref"], ["hf"], False),
    ("fp32-sft", "tiny", "fp32", {"name": "sft"}, None, SFT_BATCH, ["hf", "hf-ckpt"], False),
    ("fp32-grpo-lora", "tiny", "fp32", grpo(beta=0.04, loss_type="bnpo"), "rank=4,alpha=8,init=random", GRPO_BATCH,
     ["hf"], False),
    ("bf16-sft", "tiny", "bf16", {"name": "sft"}, None, SFT_BATCH, ["hf", "hf-ckpt"], False),
    ("bf16-sft-lora", "tiny", "bf16", {"name": "sft"}, "rank=4,alpha=8,init=random", SFT_BATCH, ["hf"], False),
    ("bf16-grpo", "tiny", "bf16", grpo(beta=0.04, loss_type="bnpo"), None, GRPO_BATCH, ["hf"], False),
    ("bf16-dpo-lora", "tiny", "bf16", dpo(beta=0.2), "rank=4,alpha=8,init=random", DPO_BATCH, ["hf"], False),
]
DTYPE_NAMES = {"fp64": "float64", "fp32": "float32", "bf16": "bfloat16"}
CLI_KEYS = {"epsilon": "epsilon_low", "importance_sampling_level": "importance"}  # case.json name -> `run` spec key


def objective_spec(o):
    """case.json's objective as a `streambp run --objective` spec (DPO's loss_type is always sigmoid there)."""
    keys = [f"{CLI_KEYS.get(k, k)}={v}" for k, v in o.items()
            if k != "name" and v is not None and not (o["name"] == "dpo" and k == "loss_type")]
    return o["name"] + (":" + ",".join(keys) if keys else "")


def make_case(binary, work, i, name, model, dtype, objective, lora, batch_args):
    """`streambp run` writes model/, adapter/, batch.safetensors and its own gradients; case.json by hand."""
    d = work / name
    d.mkdir()
    source = ["--preset", model] if isinstance(model, str) else ["--config", work / f"{name}-config.json"]
    if not isinstance(model, str):
        (work / f"{name}-config.json").write_text(json.dumps(model))
    drop = [a for a in batch_args if a in ("no-old", "no-ref")]
    args = [binary, "run", *source, "--dtype", dtype, "--method", "standard", "--seed", 40 + i,
            *[a for a in batch_args if a not in drop], "--objective", objective_spec(objective),
            "--save-model", d / "model", "--save-batch", d / "batch.safetensors",
            "--save-grads", work / f"{name}-ref.safetensors", "--json", work / f"{name}-ref.json"]
    if lora:
        args += ["--lora", lora, "--save-adapter", d / "adapter"]
    p = subprocess.run(list(map(str, args)), capture_output=True, text=True)
    if p.returncode != 0:
        FAILURES.append(f"{name}: streambp run exited {p.returncode}\n{p.stdout}{p.stderr}")
        return None
    if drop:  # the binary rereads the trimmed batch: it recomputes the dropped tensor itself (old = current policy;
        b = load_file(str(d / "batch.safetensors"))  # ref = the base with adapters disabled)
        for k in drop:
            b.pop({"no-old": "old_logps", "no-ref": "ref_logps"}[k])
        save_file(b, str(d / "batch.safetensors"))
        args = [binary, "run", "--load", d / "model", "--dtype", dtype, "--method", "standard",
                "--batch-file", d / "batch.safetensors", "--objective", objective_spec(objective), "--force",
                "--save-grads", work / f"{name}-ref.safetensors", "--json", work / f"{name}-ref.json"]
        if lora:
            args += ["--adapter", d / "adapter"]
        p = subprocess.run(list(map(str, args)), capture_output=True, text=True)
        if p.returncode != 0:
            FAILURES.append(f"{name}: streambp run (trimmed batch) exited {p.returncode}\n{p.stdout}{p.stderr}")
            return None
    (d / "case.json").write_text(json.dumps({
        "protocol": protocol.PROTOCOL, "case": name, "description": f"tests/oracle/conform_adapters.py case {name}",
        "dtype": DTYPE_NAMES[dtype], "objective": objective, "lora": bool(lora), "chunks": {"layer": 5, "head": 7},
        "returns": "grads.safetensors (trainable tensors, model dtype) and result.json"}, indent=1))
    truth = None
    if dtype != "fp64":  # the exact gradients of the same (rounded) weights and batch, for the low-precision rule
        args = [binary, "run", "--load", d / "model", "--dtype", "fp64", "--method", "standard", "--batch-file",
                d / "batch.safetensors", "--objective", objective_spec(objective), "--save-grads", work / f"{name}-fp64.safetensors"]
        if lora:
            args += ["--adapter", d / "adapter"]
        p = subprocess.run(list(map(str, args)), capture_output=True, text=True)
        if p.returncode != 0:
            FAILURES.append(f"{name}: streambp run (fp64 truth) exited {p.returncode}\n{p.stdout}{p.stderr}")
            return None
        truth = load_file(str(work / f"{name}-fp64.safetensors"))
    ref_loss = json.loads((work / f"{name}-ref.json").read_text())["loss"]
    return d, load_file(str(work / f"{name}-ref.safetensors")), ref_loss, truth


def run_adapter(d, adapter):
    for f in ("grads.safetensors", "result.json"):
        (d / f).unlink(missing_ok=True)
    via_cli = adapter.startswith("cli:")
    adapter = adapter.removeprefix("cli:")
    argv = (["--gradient-checkpointing"] if adapter == "hf-ckpt" else []) + [str(d)]
    start = time.perf_counter()
    MLP_FORWARDS.clear()
    if via_cli:
        script = CONFORM / {"wrong": "wrong_per_chunk.py", "example": "example_adapter.py"}.get(adapter, "hf_adapter.py")
        p = subprocess.run(["nice", "-n", "10", sys.executable, str(script), *argv], capture_output=True, text=True)
        rc, err = p.returncode, p.stderr
    else:
        rc, err = protocol.main(argv, wrong_per_chunk.loss if adapter == "wrong" else losses.loss, "usage"), ""
    wall = time.perf_counter() - start
    if not via_cli and len(MLP_FORWARDS) != (2 if adapter == "hf-ckpt" else 1):
        return None, None, None, wall, f"layer 0's MLP ran {len(MLP_FORWARDS)} times (checkpointing recomputes it once)"
    if rc != 0 or not (d / "result.json").exists():
        return None, None, None, wall, f"exit {rc}: {err.strip()[-500:]}"
    result = json.loads((d / "result.json").read_text())
    return result["loss"], load_file(str(d / "grads.safetensors")), result.get("seconds"), wall, ""


MLP_FORWARDS = []  # layer 0's MLP forwards under autograd in the last in-process run: 2 with checkpointing, else 1
load_model = protocol.load_model


def counting_load_model(case, gradient_checkpointing=False):
    """protocol.load_model, with layer 0's MLP counting its forwards (module hooks do not see HF's recompute)."""
    model, trainable = load_model(case, gradient_checkpointing)
    mlp = next(m for n, m in model.named_modules() if n.endswith("layers.0.mlp"))
    forward = mlp.forward

    def counted(*args, **kwargs):
        if torch.is_grad_enabled():  # not a no_grad reference pass (LoRA without ref_logps)
            MLP_FORWARDS.append(1)
        return forward(*args, **kwargs)

    mlp.forward = counted
    return model, trainable


protocol.load_model = counting_load_model


def largest_error(ref, ours):
    """streambp compare's rule: normwise max|a-b|/max|a| per tensor; degenerate tensors against 1e-4 of the global max."""
    if set(ref) != set(ours):
        return float("inf"), f"names differ: {sorted(set(ref) ^ set(ours))[:4]}"
    global_max = max(g.double().abs().max().item() for g in ref.values())
    worst, worst_name = 0.0, "-"
    for n, g in ref.items():
        if ours[n].dtype != g.dtype or ours[n].shape != g.shape:
            return float("inf"), f"{n}: {ours[n].dtype}{list(ours[n].shape)} vs the harness's {g.dtype}{list(g.shape)}"
        scale = max(g.double().abs().max().item(), DEGENERATE * global_max)
        err = (ours[n].double() - g.double()).abs().max().item() / scale
        if not err <= worst:
            worst, worst_name = err, n
    return worst, worst_name


def check(binary, case, made):
    name, _, dtype, _, _, _, adapters, _ = case
    d, ref_grads, ref_loss, truth = made
    for adapter in adapters:
        loss, grads, seconds, wall, err = run_adapter(d, adapter)
        label = f"{name} [{adapter}]"
        if grads is None:
            FAILURES.append(f"{label}: {err}")
            print(f"FAIL: {label}: {err}")
            continue
        gerr, where = largest_error(ref_grads, grads)
        lerr = abs(loss - ref_loss) / abs(ref_loss)
        numbers = (f"loss {loss:.15g} (binary {ref_loss:.15g}, rel {lerr:.1e}), largest gradient error {gerr:.2e} "
                   f"in {where}; fwd+bwd {seconds:.2f} s, adapter {wall:.1f} s")
        if dtype != "fp64":  # the binary's standard BP in this dtype is the baseline, not the judge
            ratio, where, ok, _ = low_precision_verdict(binary, truth, ref_grads, grads, dtype)
            print(f"{'ok' if ok else 'FAIL'}: {label}: low-precision rule {ratio:.2f} of its allowance in {where} "
                  f"(against the binary's {dtype} standard BP: {numbers})")
            if not ok:
                FAILURES.append(f"{label}: {ratio:.2f}x the low-precision allowance in {where}")
            continue
        passed = gerr <= GRAD_RTOL and lerr <= LOSS_RTOL
        expected = adapter.removeprefix("cli:") != "wrong"
        ok = passed == expected
        print(f"{'ok' if ok else 'FAIL'}: {label}: {'passes' if passed else 'fails'} ({numbers})")
        if not ok:
            FAILURES.append(f"{label}: expected to {'pass' if expected else 'fail'} 1e-10: {numbers}")


def main():
    binary, run_all = sys.argv[1], "--all" in sys.argv[2:]
    start = time.time()
    torch.set_num_threads(1)  # tiny models; the machine is shared
    print(f"transformers {transformers.__version__}, peft {peft.__version__}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(CASES):
            if not (run_all or case[-1]):
                continue
            made = make_case(binary, Path(tmp), i, *case[:6])
            if made:
                check(binary, case, made)
    for f in FAILURES:
        print("FAIL:", f)
    print(f"{'FAILED' if FAILURES else 'passed'}: {len(FAILURES)} failure(s), {time.time() - start:.1f} s")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
