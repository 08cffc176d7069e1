"""HF Transformers models that keep fp64 in fp64, as the harness's oracle does.

HF's RMSNorm of the families the harness's cases use (Qwen3, Qwen2, Llama: case.json's model_type) computes its
statistics in exactly fp32 and casts back, even in an fp64 model: a correct loss on such a model is then ~3e-7 from
the oracle, far beyond the fp64 bar of 1e-10 (the first tensor named is a `...layernorm.weight`).

    from streambp_conform.hf import fp64_exact
    fp64_exact()          # every Qwen3/Qwen2/Llama model of this process
    fp64_exact(model)     # only this model's norms

The patched norm computes in at least fp32: fp64 stays fp64, and fp32 and bf16 compute exactly as HF ships them.
transformers is imported on the first call, not with the package.

    from streambp_conform.hf import model_inputs
    logits = model(**model_inputs(case)).logits   # packed rows: position_ids, no attention_mask; else the mask
"""
FAMILIES = (("qwen3", "Qwen3RMSNorm"), ("qwen2", "Qwen2RMSNorm"), ("llama", "LlamaRMSNorm"))


def rms_norm_forward(self, x):
    """HF's RMSNorm.forward, its statistics in promote_types(x.dtype, fp32) instead of fp32."""
    import torch

    xc = x.to(torch.promote_types(x.dtype, torch.float32))
    xc = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * xc.to(x.dtype)


def norm_classes():
    """The RMSNorm classes of the case families this transformers has (no Qwen3 before 4.51)."""
    import importlib

    classes = []
    for family, name in FAMILIES:
        try:
            classes.append(getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name))
        except ModuleNotFoundError:
            continue
    return tuple(classes)


def fp64_exact(model=None):
    """Make the case families' RMSNorms keep fp64: their classes (model None), or only `model`'s norms; returns
    `model`. Calling it again changes nothing."""
    import types

    classes = norm_classes()
    if model is None:
        for cls in classes:
            cls.forward = rms_norm_forward
        return None
    for module in model.modules():
        if isinstance(module, classes):
            module.forward = types.MethodType(rms_norm_forward, module)
    return model


def batch_inputs(batch):
    """model_inputs for a batch dict (Case.batch, or some of its rows): with position_ids (a packed case) input_ids and
    position_ids, no attention_mask and use_cache=False; otherwise input_ids and attention_mask."""
    if "position_ids" in batch:
        # transformers (>= 4.54) builds the block-diagonal causal mask from position_ids for SDPA and eager only when
        # no attention_mask is given and no cache is used; a 2-D mask of ones would let every sequence see the ones
        # before it. A ragged row's padding is a segment of its own after its last sequence: seen by nothing.
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def model_inputs(case, rows=None):
    """What to hand an HF causal LM for the case's rows (all, or `rows`: a list of row indices or a slice), as
    keyword arguments: model(**model_inputs(case), labels=...). A packed case (case.packed) gets input_ids and
    position_ids restarting at 0 per sequence, as DataCollatorWithFlattening writes them, and no attention_mask;
    any other case input_ids and attention_mask."""
    import torch

    b = case.batch
    if rows is not None:
        index = rows if isinstance(rows, slice) else torch.as_tensor(rows, dtype=torch.long)
        per_sequence = getattr(case, "per_sequence", ())  # packed GRPO's advantages [n]: not per row, not an input
        b = {k: (v[index] if isinstance(index, slice) else v.index_select(0, index)) for k, v in b.items()
             if k not in per_sequence}
    return batch_inputs(b)
