#!/usr/bin/env python3
"""Unsloth (PyPI unsloth + unsloth_zoo) under the conformance protocol streambp-conform/1, SFT, full fine-tuning or
LoRA, through its documented entry point FastLanguageModel:

    from unsloth import FastLanguageModel                       # before transformers, as Unsloth asks
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=DIR, max_seq_length=T, dtype=DTYPE,
        load_in_4bit=False, full_finetuning=not LoRA, use_gradient_checkpointing="unsloth")
    model = FastLanguageModel.get_peft_model(model, r=..., lora_alpha=..., target_modules=[...], lora_dropout=0,
        bias="none", use_gradient_checkpointing="unsloth", use_rslora=...)       # LoRA cases; weights from adapter/
    FastLanguageModel.for_training(model)
    loss = model(input_ids=..., attention_mask=..., labels=...).loss            # Unsloth's fused CE on its forward

use_gradient_checkpointing="unsloth" is Unsloth's offloaded gradient checkpointing (activations to host RAM, the
setting of Unsloth issue #255) and its default; --no-checkpointing passes False instead.

Usage: unsloth_adapter.py [--gradient-checkpointing] [--no-checkpointing] [--cpu-backend] CASE_DIR

Without a GPU it exits 2 with "needs a GPU: ..." before importing Unsloth. --cpu-backend runs anyway: without an
accelerator `import unsloth` (2026.x) selects its CPU backend (unsloth/_cpu_init.py): stock transformers + PEFT,
"unsloth" checkpointing as plain non-reentrant recomputation, and unsloth_zoo.cpu's chunked linear cross-entropy
(which its SFTTrainer switches on per step; so does this adapter). That is a different code path from the GPU one.
The case's model/ has no tokenizer, which both loaders insist on: a word-level one over the config's vocabulary is
written beside a link to the weights (its pad/eos are existing ids, so nothing is resized).
"""
import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_common  # noqa: E402
from gpu_common import CaseError, NotExpressible  # noqa: E402

FLAGS = ("--no-checkpointing", "--cpu-backend")
USAGE = "Usage: unsloth_adapter.py [--gradient-checkpointing] [--no-checkpointing] [--cpu-backend] CASE_DIR"


def device():
    if "--cpu-backend" in sys.argv[1:]:
        return "cpu"
    reason = gpu_common.no_gpu_reason()
    if reason is None:
        return "cuda"
    raise CaseError(f"needs a GPU: {reason}; Unsloth's FastLanguageModel (Triton kernels, offloaded 'unsloth' "
                    "checkpointing) needs CUDA/ROCm/XPU: without one `import unsloth` falls back to its CPU backend "
                    "(plain HF + PEFT + chunked CE; --cpu-backend runs it) or, with UNSLOTH_DISABLE_CPU_FALLBACK=1, "
                    "raises 'NotImplementedError: Unsloth cannot find any torch accelerator? You need a GPU.'")


def model_dir_with_tokenizer(case, tmp):
    """model/ as Unsloth wants it: the checkpoint (linked) plus a tokenizer over the config's vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(tmp) / "model"
    out.mkdir()
    for f in (case.dir / "model").iterdir():
        (out / f.name).symlink_to(f.resolve())
    config = json.loads((case.dir / "model" / "config.json").read_text())
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else (eos if isinstance(eos, int) else config["vocab_size"] - 1)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token=f"t{eos}", pad_token=f"t{eos}",
                            model_max_length=config.get("max_position_embeddings", 4096)).save_pretrained(out)
    return out


def load(case, flags):
    import torch

    if case.dtype == torch.float64 and "--cpu-backend" not in flags:
        # unsloth/models/llama.py FastLlamaModel.from_pretrained: assert dtype in (float16, bfloat16, float32)
        raise NotExpressible("Unsloth's GPU loader asserts dtype float16/bfloat16/float32: no float64")
    import unsloth  # noqa: F401  (first: it patches transformers, PEFT and TRL on import)
    from unsloth import FastLanguageModel

    checkpointing = False if "--no-checkpointing" in flags else "unsloth"
    T = int(case.batch["input_ids"].size(1))
    tmp = tempfile.mkdtemp(prefix="unsloth-case-")
    atexit.register(shutil.rmtree, tmp, True)
    model, _ = FastLanguageModel.from_pretrained(
        model_name=str(model_dir_with_tokenizer(case, tmp)), max_seq_length=max(T, 16), dtype=case.dtype,
        load_in_4bit=False, load_in_8bit=False, full_finetuning=not case.lora, fix_tokenizer=False,
        use_gradient_checkpointing=checkpointing, local_files_only=True)
    if case.lora:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        cfg = json.loads((case.dir / "adapter" / "adapter_config.json").read_text())
        if cfg.get("lora_dropout", 0.0) != 0.0 or cfg.get("use_dora") or cfg.get("modules_to_save"):
            raise CaseError("adapter_config.json: lora_dropout > 0, DoRA or modules_to_save (not mapped here)")
        model = FastLanguageModel.get_peft_model(
            model, r=cfg["r"], lora_alpha=cfg["lora_alpha"], target_modules=cfg["target_modules"], lora_dropout=0.0,
            bias=cfg.get("bias", "none"), use_rslora=bool(cfg.get("use_rslora")), use_gradient_checkpointing=checkpointing,
            init_lora_weights=False)
        saved = load_file(str(case.dir / "adapter" / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(model, saved)
        trainable = {gpu_common.protocol.saved_peft_name(n): p for n, p in model.named_parameters() if p.requires_grad}
        if set(saved) != set(trainable) or getattr(result, "unexpected_keys", None):
            raise CaseError(f"adapter: file vs Unsloth's trainable LoRA tensors differ: "
                            f"{sorted(set(saved) ^ set(trainable))[:6]}")
    else:
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    FastLanguageModel.for_training(model)
    if "--cpu-backend" in flags:  # what unsloth_zoo.cpu.trainer's SFT compute_loss does around each step
        for m in (model, getattr(model, "get_base_model", lambda: None)()):
            if m is not None and getattr(m, "_unsloth_cpu_chunked_ce", False):
                m._unsloth_cpu_chunked_ce_active = True
    return model, trainable


def loss(model, case, flags):
    b = case.batch
    return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss


if __name__ == "__main__":
    if "--cpu-backend" not in sys.argv[1:]:
        os.environ.setdefault("UNSLOTH_DISABLE_CPU_FALLBACK", "1")  # never train on CPU by accident
    sys.exit(gpu_common.main(sys.argv[1:], USAGE, FLAGS, device, None, loss, load=load))
