#!/usr/bin/env python3
"""A minimal conformance adapter (protocol streambp-conform/1): SFT, full fine-tuning or LoRA, one process. Copy it
and replace the marked lines with your implementation. Run it with a python that has torch, transformers and peft
(the harness's venv has them; the harness appends the case directory):
  streambp conform --impl "~/.cache/streambp/venv-torch-2.14.1/bin/python example_adapter.py" --cases quick
A case your implementation does not do (here GRPO, DPO, several ranks) exits with status 3 and the reason on stderr:
the harness reports it N/A, neither passed nor failed. fp64 is judged at 1e-10 against an exact fp64 computation, so
fp64 must stay fp64 throughout: HF's RMSNorms round to fp32 (patched below) and so does HF's built-in loss (not used:
F.cross_entropy keeps fp64)."""
import json, os, sys, time
from pathlib import Path

case = Path(sys.argv[-1])
meta = json.loads((case / "case.json").read_text())
if meta["protocol"] != "streambp-conform/1":
    sys.exit(f"{case}: protocol {meta['protocol']}; this adapter speaks streambp-conform/1")


def decline(why):  # exit status 3: the case is N/A for this implementation
    print(why, file=sys.stderr)
    sys.exit(3)


# Before importing torch, so that a declined case costs nothing.
if meta["objective"]["name"] != "sft":
    decline(f"objective {meta['objective']['name']}: this adapter implements SFT only")
if meta.get("ranks", 1) != 1:  # absent in files written before the protocol had ranks: one process
    decline(f"{meta['ranks']} ranks: this adapter runs one process")
if "micro_batches" in meta:  # a step of several micro-batches: hf_adapter.py shows how to accumulate them
    decline(f"{len(meta['micro_batches'])} micro-batches: this adapter runs one batch per step")

import torch, torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

dtype = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}[meta["dtype"]]
b = load_file(str(case / "batch.safetensors"))  # input_ids, attention_mask, labels: [B, T] int64


def rms_norm(self, x):  # HF's RMSNorm, computing in (at least) fp32 instead of exactly fp32
    xc = x.to(torch.promote_types(x.dtype, torch.float32))
    return self.weight * (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)


# Every model family the matrix writes (config.json's model_type): Qwen3 with qk-norm, Qwen2 without, Llama.
for norm in (modeling_qwen3.Qwen3RMSNorm, modeling_qwen2.Qwen2RMSNorm, modeling_llama.LlamaRMSNorm):
    norm.forward = rms_norm

# --- your implementation: the loss and the gradient of every trainable tensor ---
model = transformers.AutoModelForCausalLM.from_pretrained(case / "model", dtype=dtype)
if meta["lora"]:  # case / "adapter" is a PEFT adapter; without autocast_adapter_dtype=False PEFT holds bf16 ones in fp32
    from peft import PeftModel
    model = PeftModel.from_pretrained(model, case / "adapter", is_trainable=True, autocast_adapter_dtype=False)
start = time.perf_counter()
logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits  # [B, T, V]
targets = F.pad(b["labels"], (0, 1), value=-100)[:, 1:]  # position t predicts token t + 1; -100: not a target
loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)  # mean over the batch's targets
loss.backward()
seconds = time.perf_counter() - start
# HF's parameter names (a tied lm_head appears once); under LoRA only the adapters, named as PEFT's adapter file names
# them: named_parameters() says "...lora_A.default.weight", the file (and the harness) "...lora_A.weight".
grads = {n.replace(".default.", "."): p.grad.to(dtype).contiguous()
         for n, p in model.named_parameters() if p.requires_grad}
# --- end of your implementation ---

# Atomic writes (temporary file, then rename): a killed adapter never leaves a half file. Gradients first.
save_file(grads, str(case / "grads.safetensors.tmp"))
os.replace(case / "grads.safetensors.tmp", case / "grads.safetensors")
(case / "result.json.tmp").write_text(json.dumps({"loss": loss.item(), "seconds": seconds}))
os.replace(case / "result.json.tmp", case / "result.json")
