#!/usr/bin/env python3
"""A minimal conformance adapter on the streambp_conform package (`pip install ./verify/conform`): SFT, full
fine-tuning or LoRA, one process. Copy it and replace the body of `gradients` with your implementation. Run it with a
python that has torch, transformers and peft (the harness's venv has them; the harness appends the case directory):
  streambp conform --impl "~/.cache/streambp/venv-torch-2.14.1/bin/python example_adapter.py" --cases quick
A case it does not do (GRPO, DPO, several ranks, micro-batch steps) exits with status 3 and the reason: the harness
reports it N/A, neither passed nor failed. fp64 is judged at 1e-10 against an exact fp64 computation, so fp64 must stay
fp64 throughout: HF's RMSNorms round to fp32 (streambp_conform.hf.fp64_exact patches them) and so does HF's built-in
loss (not used: F.cross_entropy keeps fp64)."""
import sys
from pathlib import Path

try:
    from streambp_conform import Case, run
except ImportError:  # not installed: the checkout's copy beside this file
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from streambp_conform import Case, run
from streambp_conform.hf import fp64_exact, model_inputs


def gradients(case: Case):
    """The loss and the gradient of every trainable tensor, by HF's parameter names (a tied lm_head appears once)."""
    import torch.nn.functional as F
    import transformers

    fp64_exact()  # every model family the matrix writes (Qwen3, Qwen2, Llama): RMSNorm in at least fp32
    # --- your implementation ---
    model = transformers.AutoModelForCausalLM.from_pretrained(case.model_dir, dtype=case.dtype)
    if case.lora:  # without autocast_adapter_dtype=False PEFT holds bf16 adapters in fp32
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, case.adapter_dir, is_trainable=True, autocast_adapter_dtype=False)
    b = case.batch  # input_ids, attention_mask, labels: [B, T] int64 (packed rows: position_ids too)
    # input_ids with attention_mask; packed rows (case.packed): position_ids and no mask, HF's own packed path
    logits = model(**model_inputs(case)).logits  # [B, T, V]
    targets = F.pad(b["labels"], (0, 1), value=-100)[:, 1:]  # position t predicts token t + 1; -100: not a target
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)  # mean over the batch's targets
    loss.backward()
    # --- end of your implementation ---
    # PEFT's in-memory names ("...lora_A.default.weight") are fine: the package saves them as PEFT's files name them.
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


if __name__ == "__main__":
    from streambp_conform.warm import delegate

    delegate()  # optional: run in a warm worker, imports done, when STREAMBP_CONFORM_WARM names one (docs/conformance.md)
    # GRPO and DPO declined before torch loads; packed rows run (model_inputs keeps each sequence to itself)
    sys.exit(run(gradients, objectives={"sft"}, packs=True))
