#!/usr/bin/env python3
"""Apple's Cut Cross-Entropy (import cut_cross_entropy) under the conformance protocol streambp-conform/1, SFT, full
fine-tuning or LoRA.

Usage: cce_adapter.py [--gradient-checkpointing] [--exact | --torch-compile] CASE_DIR

The documented usage (README "Basic usage"): the decoder's hidden states and the classifier weight go to
    linear_cross_entropy(embeddings, classifier, labels, shift=1)
instead of lm_head + F.cross_entropy; here embeddings = model.model(input_ids, attention_mask).last_hidden_state
[B, T, H], classifier = lm_head.weight (the embedding under a tied head), labels [B, T] with -100 (ignore_index's
default), reduction "mean" (over the target tokens, as HF's loss). The package's HF patch (cut_cross_entropy.
transformers.cce_patch, git versions only) is written against transformers 4.48 and has no qwen3, so it is not used.

(default)        impl="cce" with the library's gradient filter: filter_eps="auto" (git) / "high" (PyPI 25.1.1), both
                 torch.finfo(dtype).eps / 32: backward blocks whose every |d logit| is below it are skipped.
--exact          git >= 25.1.1 (has LinearCrossEntropyImpl.CCE_EXACT): impl="cce_exact" = filter_eps=None,
                 accum_e_fp32=True, accum_c_fp32=True (cce_utils.CCEPresets). PyPI 25.1.1 has no such impl: there
                 filter_eps=None (no filtering; dE/dC still reduced in the embedding dtype).
--torch-compile  impl="torch_compile": the package's pure-PyTorch path (torch.compile of e @ c.T and
                 F.cross_entropy(logits.float())): materialises the logits, runs on CPU too (no GPU needed).

Runs on CUDA (Ampere or newer per the README). Without a GPU it exits 2 with "needs a GPU: ...", except
--torch-compile (runs on CPU), or TRITON_INTERPRET=1 (CCE's Triton kernels in Triton's CPU interpreter; the git
versions' torch.cuda.is_bf16_supported() check is then answered True). PyPI 25.1.1's backward accepts bf16/fp16
embeddings only: fp32/fp64 cases exit 3 (not expressible) there. CCE computes the loss in fp32: fp64 cases are not expected to meet
the fp64 bar.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_common  # noqa: E402
from gpu_common import CaseError, NotExpressible  # noqa: E402

FLAGS = ("--exact", "--torch-compile")
USAGE = "Usage: cce_adapter.py [--gradient-checkpointing] [--exact | --torch-compile] CASE_DIR"


def device():
    import torch

    if "--torch-compile" in sys.argv[1:]:
        return "cuda" if torch.cuda.is_available() else "cpu"
    dev = gpu_common.pick_device("CCE's kernels are Triton programs for CUDA, Ampere or newer (on CPU Triton raises "
                                 "'RuntimeError: 0 active drivers ([]). There should only be one.'; git versions "
                                 "first raise 'Cut Cross Entropy requires an ampere GPU or newer.'); "
                                 "--torch-compile is its CPU path", triton_interpretable=True)
    if dev == "cpu":  # interpreter: git versions refuse without bf16-capable CUDA before any kernel runs
        torch.cuda.is_bf16_supported = lambda *args, **kwargs: True
    return dev


def base_of(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def cce_options(case, flags):
    import torch
    from cut_cross_entropy import LinearCrossEntropyImpl

    if "--exact" in flags and "--torch-compile" in flags:
        raise CaseError("--exact and --torch-compile exclude each other")
    if "--torch-compile" in flags:
        return {"impl": "torch_compile"}
    has_exact = "CCE_EXACT" in LinearCrossEntropyImpl.__members__
    if not has_exact and case.dtype not in (torch.bfloat16, torch.float16):
        # PyPI 25.1.1: cce_backward_kernel asserts "Backwards requires embeddings to be bf16 or fp16"
        raise NotExpressible(f"cut-cross-entropy without cce_exact (PyPI 25.1.1) has no {case.dtype} backward "
                        "('Backwards requires embeddings to be bf16 or fp16')")
    if "--exact" in flags:
        return {"impl": "cce_exact"} if has_exact else {"impl": "cce", "filter_eps": None}
    return {"impl": "cce"}


def prepare(case, model, flags):
    cce_options(case, flags)  # refuse a case it cannot run before the step
    return model


def loss(model, case, flags):
    from cut_cross_entropy import linear_cross_entropy

    b = case.batch
    base = base_of(model)
    hidden = base.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
    return linear_cross_entropy(hidden, base.lm_head.weight, b["labels"], ignore_index=-100, reduction="mean",
                                shift=1, **cce_options(case, flags))


if __name__ == "__main__":
    sys.exit(gpu_common.main(sys.argv[1:], USAGE, FLAGS, device, prepare, loss))
