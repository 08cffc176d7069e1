#!/usr/bin/env python3
"""A minimal conformance adapter (protocol streambp-conform/1, SFT, full fine-tuning): copy it and replace the marked
lines with your implementation. Run:  streambp conform --impl "python example_adapter.py" ...  (the harness appends
the case directory). fp64 is judged at 1e-10 against an exact fp64 computation, so fp64 must stay fp64 throughout:
HF's RMSNorm rounds to fp32 (patched below) and so does HF's built-in loss (not used: F.cross_entropy keeps fp64)."""
import json, os, sys, time
from pathlib import Path
import torch, torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

case = Path(sys.argv[-1])
meta = json.loads((case / "case.json").read_text())
assert meta["protocol"] == "streambp-conform/1" and meta["objective"]["name"] == "sft" and not meta["lora"]
dtype = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}[meta["dtype"]]
b = load_file(str(case / "batch.safetensors"))  # input_ids, attention_mask, labels: [B, T] int64

class RMSNorm(torch.nn.Module):  # HF's Qwen3RMSNorm, computing in (at least) fp32 instead of exactly fp32
    def forward(self, x):
        xc = x.to(torch.promote_types(x.dtype, torch.float32))
        return self.weight * (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)
transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm.forward = RMSNorm.forward

# --- your implementation: the loss and the gradient of every parameter, under HF's parameter names ---
model = transformers.AutoModelForCausalLM.from_pretrained(case / "model", dtype=dtype)
start = time.perf_counter()
logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits  # [B, T, V]
targets = F.pad(b["labels"], (0, 1), value=-100)[:, 1:]  # position t predicts token t + 1; -100: not a target
loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)  # mean over the batch's targets
loss.backward()
seconds = time.perf_counter() - start
grads = {n: p.grad.to(dtype).contiguous() for n, p in model.named_parameters()}  # a tied lm_head appears once
# Under LoRA (meta["lora"] set; the adapter is in case / "adapter", PEFT's format) return only the adapters, under the
# names PEFT writes to adapter_model.safetensors: named_parameters() says "...lora_A.default.weight", the file (and
# the harness) "...lora_A.weight":
#   grads = {n.replace(".default.", "."): p.grad.to(dtype).contiguous()
#            for n, p in peft_model.named_parameters() if p.requires_grad}
# --- end of your implementation ---

# Atomic writes (temporary file, then rename): a killed adapter never leaves a half file. Gradients first.
save_file(grads, str(case / "grads.safetensors.tmp"))
os.replace(case / "grads.safetensors.tmp", case / "grads.safetensors")
(case / "result.json.tmp").write_text(json.dumps({"loss": loss.item(), "seconds": seconds}))
os.replace(case / "result.json.tmp", case / "result.json")
