"""Our fp32 and bf16 runs are as accurate as HF's own: on one checkpoint whose weights are bf16-representable and one
batch, the gradients of our standard BP and of StreamBP in fp32 and in bf16 pass the harness's low-precision rule with
transformers' own Qwen3 in the same dtype as the baseline: on every tensor, an l2 error within allowance(n) x HF's +
a rounding floor (verify/grad_compare.h; judged by `streambp compare --baseline`, the rule of the tests, verify --gate
and conform), both measured against the fp64 oracle (our standard BP in fp64, itself equal to HF's fp64 to 1e-10:
tests/oracle/hf_parity.py).

Usage: python tests/oracle/hf_low_precision.py BUILD/streambp
"""
# ctest-fault: hf_low_precision_fault STREAMBP_PARITY_FAULT=0.1 FAIL: .*(normwise relative error|gradient error|of the allowance)
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # the oracles' shared helpers
from parity_metrics import low_precision_verdict, stop_if_fault_run, with_fault  # noqa: E402

TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}
FAILURES = []


def run(binary, *args):
    p = subprocess.run([binary, "run", *map(str, args)], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"streambp run failed: {p.stdout}{p.stderr}")


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
            hf = hf_gradients(model, batch, dtype)
            for method in ("standard", "streambp:layer_chunk=16,head_chunk=16"):
                grads = work / f"{dtype}-{method.split(':')[0]}.safetensors"
                run(binary, "--load", model, "--batch-file", batch_file, "--method", method, "--dtype", dtype,
                    "--save-grads", grads)
                ours = with_fault(load_file(str(grads)))
                ratio, worst, passed, summary = low_precision_verdict(binary, oracle, hf, ours, dtype)
                line = f"{dtype} {method}: worst {worst}: {ratio:.2f} of the allowance (HF {dtype} as the baseline)"
                print(("ok: " if passed else "FAIL: ") + line)
                if not passed:
                    FAILURES.append(line + "\n  " + summary)
                    stop_if_fault_run()
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
