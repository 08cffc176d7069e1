"""Our fp32 and bf16 runs are as accurate as HF's own: on one checkpoint whose weights are bf16-representable and one
batch, the gradients of our standard BP and of StreamBP in fp32 and in bf16 are, on every tensor, within 2x the (l2) error
that transformers' own Qwen3 makes in the same dtype (+ the rounding floor of verify/grad_compare.h's
low_precision_floor: the error of storing every entry at 1e-4 of the largest gradient entry), both measured against the
fp64 oracle (our standard BP in fp64, itself equal to HF's fp64 to 1e-10: tests/hf_parity.py). DESIGN §8's rule.

Usage: python tests/hf_low_precision.py BUILD/streambp
"""
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import torch
    import transformers
    from safetensors.torch import load_file
except ImportError as e:  # an oracle that cannot run fails: a CI without its oracles is not green
    print(f"FAIL: missing oracle dependency: {e} (make installs transformers into the venv)")
    sys.exit(1)

from parity_metrics import finite, normwise_error  # noqa: E402

UNIT_ROUNDOFF = {"fp32": 2.0 ** -24, "bf16": 2.0 ** -8}  # eps / 2, as unit_roundoff (verify/grad_compare.cpp)
TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}
FAILURES = []


def run(binary, *args):
    p = subprocess.run([binary, "run", *map(str, args)], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"streambp run failed: {p.stdout}{p.stderr}")


def l2_scales(ref):
    """Per tensor: the model-wide floor of compare --help times sqrt(numel), and l2_error's denominator."""
    floor = 1e-4 * max(t.abs().max().item() for t in ref.values())
    return {n: (floor * a.numel() ** 0.5, max(a.norm().item(), floor * a.numel() ** 0.5)) for n, a in ref.items()}


def l2_error(ref, other):
    """||a-b|| / ||a|| per tensor (the low-precision rule's metric, verify/grad_compare.h), with the model-wide floor of
    compare --help for zero/rounding-level tensors: max(||a||, floor * sqrt(numel))."""
    scales = l2_scales(ref)
    return {n: finite(((other[n].double() - a).norm() / scales[n][1]).item()) for n, a in ref.items()}


def rounding_floor(ref, dtype):
    """The rule's floor per tensor, relative like l2_error: u * floor * sqrt(numel) / scale (low_precision_floor)."""
    return {n: UNIT_ROUNDOFF[dtype] * floor_norm / scale for n, (floor_norm, scale) in l2_scales(ref).items()}


def hf_gradients(model_dir, batch, dtype):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=TORCH_DTYPE[dtype], attn_implementation="sdpa")
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    shifted = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100).backward()
    return {n: p.grad.double() for n, p in model.named_parameters()}


def main():
    binary = sys.argv[1]
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, batch_file = work / "model", work / "batch.safetensors"
        # The checkpoint is saved in bf16, so every run below (fp64, fp32, bf16) starts from the same weights.
        run(binary, "--preset", "tiny", "--method", "standard", "--dtype", "bf16", "--batch", "2", "--seq", "160",
            "--pad-fraction", "0.2", "--prompt-fraction", "0.2", "--seed", "5", "--save-model", model,
            "--save-batch", batch_file)
        run(binary, "--load", model, "--batch-file", batch_file, "--method", "standard", "--dtype", "fp64",
            "--save-grads", work / "oracle.safetensors")
        oracle = {n: t.double() for n, t in load_file(str(work / "oracle.safetensors")).items()}
        batch = load_file(str(batch_file))
        for dtype in ("fp32", "bf16"):
            hf_error = l2_error(oracle, hf_gradients(model, batch, dtype))
            for method in ("standard", "streambp:layer_chunk=16,head_chunk=16"):
                grads = work / f"{dtype}-{method.split(':')[0]}.safetensors"
                run(binary, "--load", model, "--batch-file", batch_file, "--method", method, "--dtype", dtype,
                    "--save-grads", grads)
                ours = l2_error(oracle, load_file(str(grads)))
                floor = rounding_floor(oracle, dtype)
                worst = max(ours, key=lambda n: ours[n] / (2 * hf_error[n] + floor[n]))
                ratio = ours[worst] / (2 * hf_error[worst] + floor[worst])
                line = (f"{dtype} {method}: worst {worst}: ours {ours[worst]:.2e}, HF {hf_error[worst]:.2e} "
                        f"({ratio:.2f} of the allowance 2x HF + floor)")
                print(("ok: " if ratio <= 1 else "FAIL: ") + line)
                if ratio > 1:
                    FAILURES.append(line)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
