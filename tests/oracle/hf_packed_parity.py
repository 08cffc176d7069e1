"""Packed rows compute HF Transformers' packed function: `streambp run --pack` with every method gives the loss and every
parameter gradient of transformers' own packed forward and backward on the same checkpoint and batch, in fp64, to 1e-10
(normwise). HF's packed path is the one DataCollatorWithFlattening feeds: position_ids restarting at 0 and no
attention_mask, from which transformers builds the block-diagonal causal mask (masking_utils'
find_packed_sequence_indices) for SDPA and eager attention alike.

The oracle is shown to see the packing: the same batch through HF with an attention_mask of ones (a plain causal mask
over the whole row, attention across every boundary) must be far from ours.

Usage: python tests/oracle/hf_packed_parity.py BUILD/streambp
"""
# ctest-fault: hf_packed_parity_fault STREAMBP_PARITY_FAULT=1e-6 FAIL: .*normwise relative error
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from hf_parity import SMALL_CONFIG, patch_rms_norms  # noqa: E402  (the one RMSNorm patch, shared; this script's folder)
from parity_metrics import finite, normwise_error, run_cases, with_fault  # noqa: E402

RTOL = 1e-10
# HF's eager attention rounds its softmax to fp32 even in an fp64 model (eager_attention_forward: softmax(...,
# dtype=torch.float32)), so against it the bar is fp32 rounding (measured 2.4e-7 on tiny); a leak across a boundary
# is O(1). It shows that eager builds the same packed mask as SDPA, which is judged at RTOL.
RTOL_BY_IMPLEMENTATION = {"sdpa": RTOL, "eager": 1e-5}
# Every method, with chunks that straddle the batch's boundaries (B = 2, T = 40, sequences of 1 to 16 tokens).
METHODS = ["standard", "checkpoint", "mst:mini_seq=3", "streambp:layer_chunk=7,head_chunk=5"]
PACK = ["--pack", "uniform:min=1,max=16", "--batch", "2", "--seq", "40", "--prompt-fraction", "0.2", "--seed", "7"]


def ours(binary, work, name, source_args, method):
    tag = f"{name}-{method.split(':')[0]}"
    model_dir, grads, batch, record = (work / f"{tag}-model", work / f"{tag}.safetensors", work / f"{tag}-batch.safetensors",
                                       work / f"{tag}.json")
    subprocess.run([binary, "run", *source_args, *PACK, "--method", method, "--dtype", "fp64", "--save-model",
                    str(model_dir), "--save-grads", str(grads), "--save-batch", str(batch), "--json", str(record)],
                   check=True, stdout=subprocess.DEVNULL)
    return model_dir, load_file(str(batch)), with_fault(load_file(str(grads))), json.loads(record.read_text())["loss"]


def hf_step(model_dir, b, implementation, attention_mask=None):
    """HF's loss and gradients on the packed batch: position_ids only (its packed path), or with `attention_mask`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64,
                                                              attn_implementation=implementation)
    # use_cache=False as a training step runs: with a cache (the inference default) transformers skips the packed
    # detection and attends across every boundary.
    logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], attention_mask=attention_mask,
                   use_cache=False).logits
    shifted = torch.nn.functional.pad(b["labels"], (0, 1), value=-100)[:, 1:]  # the step's target count normalises
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def compare(what, theirs, grads, their_loss, our_loss, rtol=RTOL):
    failures, worst = [], 0.0
    if set(theirs) != set(grads):
        failures.append(f"{what}: parameter names differ: {sorted(set(theirs) ^ set(grads))}")
    for n, g in theirs.items():
        if n in grads:
            err = normwise_error(grads[n], g)
            worst = max(worst, err)
            if not err <= rtol:
                failures.append(f"{what}: {n}: normwise relative error {err:.3e}")
    if not finite(abs(their_loss - our_loss) / abs(their_loss)) <= rtol / 100:
        failures.append(f"{what}: loss {our_loss} vs HF {their_loss}")
    return failures, worst


def check(binary, work, name, source_args):
    failures = []
    runs = [ours(binary, work, name, source_args, m) for m in METHODS]
    model_dir, b = runs[0][0], runs[0][1]
    if "position_ids" not in b or "cu_seqlens" not in b:
        return [f"{name}: the saved batch has no position_ids or cu_seqlens"]
    sequences = int(b["cu_seqlens"].numel()) - 1
    for implementation in ("sdpa", "eager"):
        loss, theirs = hf_step(model_dir, b, implementation)
        for method, (_, batch, grads, our_loss) in zip(METHODS, runs):
            if not torch.equal(batch["input_ids"], b["input_ids"]):
                failures.append(f"{name} {method}: another batch than standard's")
            found, worst = compare(f"{name} {method} vs HF {implementation}", theirs, grads, loss, our_loss,
                                   RTOL_BY_IMPLEMENTATION[implementation])
            failures += found
            print(f"{name} {method} vs HF {implementation} ({sequences} sequences in 2 rows): largest gradient error "
                  f"{worst:.2e} over {len(theirs)} tensors")
    # The oracle's sensitivity: HF told the rows are plain (a mask of ones) attends across boundaries.
    _, crossing = hf_step(model_dir, b, "sdpa", attention_mask=torch.ones_like(b["input_ids"]))
    leak = max(normwise_error(runs[0][2][n], g) for n, g in crossing.items())
    print(f"{name}: HF with a plain causal mask over the packed rows is {leak:.2e} away (must be far)")
    if not leak > 1e-6:
        failures.append(f"{name}: HF's plain causal mask gives our packed gradients ({leak:.2e}): the check is blind")
    return failures


def main():
    binary = sys.argv[1]
    patch_rms_norms()
    torch.manual_seed(0)
    config = {**SMALL_CONFIG, "model_type": "llama", "tie_word_embeddings": False}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "llama-config.json").write_text(json.dumps(config))
        cases = [("tiny", ["--preset", "tiny"]), ("llama-gqa", ["--config", str(work / "llama-config.json")])]
        return run_cases(cases, lambda name, source_args: check(binary, work, name, source_args))


if __name__ == "__main__":
    sys.exit(main())
