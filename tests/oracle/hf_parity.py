"""Our decoder computes HF Transformers' function: loss and every parameter gradient of `streambp run` equal those
of transformers' own Qwen3 / Qwen2 / Llama modules on the same checkpoint and batch, in fp64, to 1e-10 (normwise).

Usage: python tests/oracle/hf_parity.py BUILD/streambp
HF rounds two things to fp32 even in an fp64 model: RMSNorm statistics (`.to(torch.float32)`) and the logits in its
loss. We keep fp64 there (docs/departures-from-hf.md): the test patches RMSNorm to upcast to *at least* fp32 and
computes the shifted-label loss itself from fp64 logits. Everything else is HF's code as shipped.
"""
# ctest-fault: hf_parity_fault STREAMBP_PARITY_FAULT=1e-6 FAIL: .*(normwise relative error|gradient error|of the allowance)
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

try:
    import transformers
    from safetensors.torch import load_file
except ImportError as e:  # an oracle that cannot run fails: a CI without its oracles is not green
    print(f"FAIL: missing oracle dependency: {e} (make installs transformers into the venv)")
    sys.exit(1)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # the oracles' shared helpers
from parity_metrics import finite, normwise_error, run_cases, with_fault  # noqa: E402

RTOL = 1e-10
# The HF config of the variants beside the tiny preset (each adds its model_type and tie_word_embeddings).
SMALL_CONFIG = {"vocab_size": 256, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0, "max_position_embeddings": 128}


def patch_rms_norms():
    """HF's RMSNorm rounds its statistics to fp32 even in an fp64 model: the one patch, shared with the conformance
    adapters (streambp_conform.hf)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "verify" / "conform"))
    from streambp_conform.hf import fp64_exact  # noqa: E402

    fp64_exact()


def check(binary, work, name, source_args):
    model_dir, grads, batch, record = work / f"{name}-model", work / f"{name}.safetensors", work / f"{name}-batch.safetensors", work / f"{name}.json"
    subprocess.run([binary, "run", *source_args, "--method", "standard", "--dtype", "fp64", "--batch", "3", "--seq", "29",
                    "--pad-fraction", "0.3", "--prompt-fraction", "0.2", "--seed", "7", "--save-model", str(model_dir),
                    "--save-grads", str(grads), "--save-batch", str(batch), "--json", str(record)],
                   check=True, stdout=subprocess.DEVNULL)
    ours_loss = json.loads(record.read_text())["loss"]
    b = load_file(str(batch))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="sdpa")
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits  # [B, T, V] fp64
    shifted = torch.nn.functional.pad(b["labels"], (0, 1), value=-100)[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)
    loss.backward()
    ours = with_fault(load_file(str(grads)))
    worst, failures = 0.0, []
    hf_grads = {n: p.grad for n, p in model.named_parameters()}
    if set(hf_grads) != set(ours):
        failures.append(f"parameter names differ: {sorted(set(hf_grads) ^ set(ours))}")
    for n, g in hf_grads.items():
        if n not in ours:
            continue
        err = normwise_error(ours[n], g)
        worst = max(worst, err)
        if not err <= RTOL:
            failures.append(f"{n}: normwise relative error {err:.3e}")
    loss_err = finite(abs(loss.item() - ours_loss) / abs(loss.item()))
    if not loss_err <= 1e-12:
        failures.append(f"loss {ours_loss} vs HF {loss.item()}")
    print(f"{name} ({model.config.model_type}): loss {loss.item():.12g}, largest gradient error {worst:.2e} over {len(hf_grads)} tensors")
    return failures


def main():
    binary = sys.argv[1]
    patch_rms_norms()
    torch.manual_seed(0)
    base = SMALL_CONFIG
    variants = {
        "qwen3-untied": {**base, "model_type": "qwen3", "tie_word_embeddings": False},
        "qwen2-bias": {**base, "model_type": "qwen2", "tie_word_embeddings": True},
        "llama-mha": {**base, "model_type": "llama", "num_key_value_heads": 4, "tie_word_embeddings": False},
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        runs = [("tiny", ["--preset", "tiny"])]
        for name, cfg in variants.items():
            (work / f"{name}-config.json").write_text(json.dumps(cfg))
            runs.append((name, ["--config", str(work / f"{name}-config.json")]))
        return run_cases(runs, lambda name, source_args: check(binary, work, name, source_args))


if __name__ == "__main__":
    sys.exit(main())
