#!/usr/bin/env python3
"""MsT (Mini-Sequence Transformer, github wdlctc/mini-s @ 797c54b) through the StreamBP conformance protocol
(streambp-conform/1): SFT, full fine-tuning, Llama-architecture cases only.

Usage: mst.py [--fork] [--fixed | --fix=A,B,C] CASE_DIR

MsT is called as its README documents it ("Benchmark"): `model.train(); model = minisequence(model)`, then
`model(input_ids=..., labels=...).loss.backward()`. minisequence() replaces LlamaForCausalLM by its
LlamaForCausalLMWarpper (LM head + loss in mini_s = 64 sequence slices, a custom autograd Function) and every
LlamaMLP by LlamaMLPWarpper (MLP in 1024-token chunks), and always turns on HF gradient checkpointing.
Nothing of MsT is copied here: it is imported from the checkout (MST_SRC: a checkout of wdlctc/mini-s at 797c54b; experiments/survey/implementations.json).

As shipped (no flag) the adapter shows MsT's own gradients. Monkeypatches, to show what the failures come from:
  A  _LM_head.backward accumulates dW into weight.grad itself and then *also returns weight.grad* as the weight's
     gradient, which autograd adds into the same tensor again (x2). Patch: return None for the weight.
  B  minis_processing cuts T-1 targets into mini_s slices of floor(T / mini_s): the last (T-1) - mini_s*floor(T/mini_s)
     targets get no gradient (the divisor still counts them); T < mini_s gives loss 0. Patch: right-pad hidden states
     (zeros) and labels (-100) to T' = mini_s*ceil((T-1)/mini_s) + 1, so the slices cover every target exactly once.
  C  fp64 only: _LM_head computes the logits as F.linear(...).float(), i.e. rounds fp64 logits to fp32 (the same
     upcast HF's own loss makes). Patch: the .float() right after MsT's F.linear keeps fp64 (fp32/bf16 unchanged).
--fixed = --fix=A,B,C.

--fork: instead of mini-s, the MsT integration of the authors' transformers fork (github wdlctc/transformers @ 5d73ef4,
4.47.0.dev0, src/transformers/integrations/mst.py; the fork must be the installed transformers, e.g.
its own venv): `model.train(); replace_model_with_minis(model)`. It patches the forward of
Llama/Qwen2/Mistral/Gemma2 classes (so Qwen2 cases run too), uses mini_s = ceil(vocab / hidden) instead of 64, and
carries the same _LM_head (A, C) and minis_processing (B) code.
"""
import json
import math
import os
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import protocol  # noqa: E402  (read_case, CaseError, quiet_hf, write_outputs)
from protocol import CaseError  # noqa: E402

# `pip install -e .` of mini-s installs an empty package map (minis/ has no __init__.py, setup.py's
# find_packages(include=["minis*"]) finds nothing), so, as the repo's own scripts do, import it from the checkout.
sys.path.insert(0, os.environ["MST_SRC"])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

USAGE = "Usage: mst.py [--fork] [--fixed | --fix=A,B,C] CASE_DIR"


# ------------------------------------------------------------------------------------------------ monkeypatches

def fix_a(ms):
    """Bug A: the weight gradient is already in weight.grad (accumulated in place by the original backward); returning
    it as well makes AccumulateGrad add it a second time. Keep the original backward, drop its third output."""
    original = ms._LM_head.backward  # bound classmethod

    def backward(cls, ctx, grad):
        grad_hidden, grad_indices, _ = original(ctx, grad)
        return grad_hidden, grad_indices, None

    ms._LM_head.backward = classmethod(backward)


def pad_for_slices(hidden_states, labels, mini_s):
    """Bug B: pad to T' = mini_s*ceil((T-1)/mini_s) + 1 so that floor(T'/mini_s) * mini_s = T' - 1 >= T - 1 targets.
    Padded positions carry hidden state 0 and label -100: no loss, no gradient, not in the divisor."""
    if labels is not None:
        T = hidden_states.size(1)
        padded = mini_s * math.ceil((T - 1) / mini_s) + 1
        if padded > T:
            hidden_states = F.pad(hidden_states, (0, 0, 0, padded - T))
            labels = F.pad(labels, (0, padded - T), value=-100)
    return hidden_states, labels


def fix_b(ms):
    if hasattr(ms, "LlamaForCausalLMWarpper"):  # mini-s: a method of the wrapper, mini_s an attribute
        original = ms.LlamaForCausalLMWarpper.minis_processing

        def minis_processing(self, hidden_states, labels):
            return original(self, *pad_for_slices(hidden_states, labels, self.mini_s))

        ms.LlamaForCausalLMWarpper.minis_processing = minis_processing
    else:  # the fork: a module function that minis_CausalLM_forward looks up by name
        original = ms.minis_processing

        def minis_processing(hidden_states, labels, lm_head, mini_s):
            return original(*pad_for_slices(hidden_states, labels, mini_s), lm_head, mini_s)

        ms.minis_processing = minis_processing


class _KeepFp64(torch.Tensor):
    """An fp64 tensor whose .float() is the identity; any other op returns a plain tensor."""
    __torch_function__ = torch._C._disabled_torch_function_impl

    def float(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor)


def fix_c(ms):
    """fp64: MsT's F.linear(...).float() (mini_sequence.py lines 73 and 103) would round the logits to fp32."""
    def linear(x, w, b=None):
        out = F.linear(x, w, b)
        return out.as_subclass(_KeepFp64) if out.dtype == torch.float64 else out

    ms.F = types.SimpleNamespace(**{k: getattr(F, k) for k in dir(F) if not k.startswith("__")})
    ms.F.linear = linear


# ------------------------------------------------------------------------------------------------ the case

def load(case, fixes, fork=False):
    import transformers
    if fork:
        try:
            from transformers.integrations import mst as ms
        except ImportError as e:
            raise CaseError(f"--fork: transformers {transformers.__version__} has no integrations.mst ({e}); install "
                            "the fork (github wdlctc/transformers)")
        supported = ("llama", "qwen2")
    else:
        from minis import mini_sequence as ms
        from minis.mini_sequence import minisequence
        supported = ("llama",)

    if case.objective["name"] != "sft":
        raise protocol.NotExpressible(f"objective {case.objective['name']}: MsT computes only the causal-LM (SFT) loss")
    if case.lora:
        raise protocol.NotExpressible("LoRA: this MsT adapter covers full fine-tuning only")
    config = json.loads((case.dir / "model" / "config.json").read_text())
    if config.get("model_type") not in supported and fork:
        raise protocol.NotExpressible(f"model_type {config.get('model_type')!r} unsupported: the fork's replace_with_minis patches "
                        "Llama/Qwen2/Mistral/Gemma2 classes only (no Qwen3)")
    if config.get("model_type") not in supported:
        raise protocol.NotExpressible(f"model_type {config.get('model_type')!r} unsupported: MsT (minis/mini_sequence.py) wraps only "
                        "transformers' LlamaForCausalLM and LlamaMLP; on a Qwen3/Qwen2 model minisequence() replaces "
                        "nothing (plain HF loss). Llama cases only: qk_norm false, attention_bias false")
    protocol.quiet_hf()
    if case.dtype == torch.float64:
        protocol.fp64_exact()  # the harness's fp64 patch (streambp_conform.hf); 4.44 has no Qwen3 to patch
    if "A" in fixes:
        fix_a(ms)
    if "B" in fixes:
        fix_b(ms)
    if "C" in fixes and case.dtype == torch.float64:
        fix_c(ms)
    new_api = tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (4, 56)
    dtype_kw = {"dtype" if new_api else "torch_dtype": case.dtype}
    hf = transformers.AutoModelForCausalLM.from_pretrained(case.dir / "model", attn_implementation="sdpa", **dtype_kw)
    if not isinstance(hf, (transformers.LlamaForCausalLM, transformers.Qwen2ForCausalLM) if fork
                      else transformers.LlamaForCausalLM):
        raise CaseError(f"config.json: {type(hf).__name__} is not a class MsT handles")
    hf.config.use_cache = False
    trainable = dict(hf.named_parameters())  # HF names; a tied lm_head appears once, as model.embed_tokens.weight
    wrong = {n: p.dtype for n, p in trainable.items() if p.dtype != case.dtype}
    if wrong:
        raise CaseError(f"model loaded in another dtype than {case.dtype}: {list(wrong.items())[:3]}")
    hf.train()
    if fork:  # the fork: replace_model_with_minis(model) = gradient_checkpointing_enable() + replace_with_minis()
        ms.replace_model_with_minis(hf)
        if type(hf).forward is not ms.minis_CausalLM_forward:
            raise CaseError("replace_model_with_minis() did not patch the causal-LM forward")
        if not hf.model.gradient_checkpointing:
            raise CaseError("replace_model_with_minis() did not turn on gradient checkpointing")
        return hf, trainable
    # MsT's README: model.train(); model = minisequence(model)  (it turns on HF gradient checkpointing itself)
    model = minisequence(hf)
    if not isinstance(model.module, ms.LlamaForCausalLMWarpper):
        raise CaseError("minisequence() did not wrap LlamaForCausalLM")
    if not model.module.model.gradient_checkpointing:
        raise CaseError("minisequence() did not turn on gradient checkpointing")
    return model, trainable


def run_step(case, model, trainable):
    """protocol.run_step, except that a tensor MsT leaves without .grad (PyTorch's "zero gradient": untied lm_head at
    T < mini_s, where every slice is empty) is written as zeros, so that the harness judges a number."""
    b = case.batch
    if "labels" not in b:
        raise CaseError("sft: batch.safetensors has no 'labels'")
    for p in trainable.values():
        p.grad = None
    start = time.perf_counter()
    loss = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss
    loss.backward()
    seconds = time.perf_counter() - start
    none = [n for n, p in trainable.items() if p.grad is None]
    if none:
        print(f"{case.name}: MsT left no .grad on {none} (written as zeros)", file=sys.stderr)
    grads = {n: (torch.zeros_like(p) if p.grad is None else p.grad).detach().to(case.dtype).contiguous()
             for n, p in trainable.items()}
    return loss.item(), grads, seconds


def main(argv):
    fixes = set()
    args = []
    fork = False
    for a in argv:
        if a == "--fork":
            fork = True
        elif a == "--fixed":
            fixes |= {"A", "B", "C"}
        elif a.startswith("--fix="):
            fixes |= {f.strip().upper() for f in a[len("--fix="):].split(",") if f.strip()}
        else:
            args.append(a)
    if len(args) != 1 or args[0].startswith("-") or not fixes <= {"A", "B", "C"}:
        print(USAGE, file=sys.stderr)
        return 2
    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        case = protocol.read_case(args[0], packs=False)  # packed rows: not declared
        if case.ranks != 1:
            raise protocol.NotExpressible(f"{case.ranks} ranks: this adapter runs one process")
        model, trainable = load(case, fixes, fork)
        loss, grads, seconds = run_step(case, model, trainable)
    except protocol.NotExpressible as e:
        print(f"{Path(argv[-1]).name}: {e}", file=sys.stderr)
        return protocol.NOT_EXPRESSIBLE
    except CaseError as e:
        print(f"{Path(args[0]).name}: {e}", file=sys.stderr)
        return 2
    protocol.write_outputs(case, loss, grads, seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
