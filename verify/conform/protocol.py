"""What the shipped HF adapters share beside the protocol, so that each adapter is only its loss: HF's model loaded as
the case says (PEFT under LoRA, fp64 kept fp64, checkpointing), one step run as a trainer runs it. The file protocol
itself (case.json, batch, grads.safetensors, result.json, exit statuses) is the installable package streambp_conform
beside this file (docs/conformance.md), imported from the checkout when it is not installed."""
import json
import sys
import time
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the checkout's streambp_conform when it is not installed
from streambp_conform.hf import fp64_exact  # noqa: E402
from streambp_conform.protocol import (NOT_EXPRESSIBLE, PROTOCOL, Case, CaseError, NotExpressible, Result,  # noqa: E402,F401
                                       micro_case, read_case, run, saved_peft_name, write_outputs)


def quiet_hf():
    """HF and PEFT print progress bars and deprecation notes on stderr; the harness keeps stderr for real errors."""
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def load_model(case, gradient_checkpointing=False):
    """HF's AutoModelForCausalLM on model/ in the case dtype (PEFT-wrapped under LoRA), and its trainable tensors by
    the names grads.safetensors must use. Train mode only with checkpointing (HF checkpoints only in training);
    dropout is 0 in the harness's configs, checked here, so both modes compute the same function."""
    import transformers

    quiet_hf()
    if case.dtype == torch.float64:  # HF's RMSNorms compute in fp32; fp32 and bf16 cases run HF as shipped
        fp64_exact()
    config = json.loads((case.dir / "model" / "config.json").read_text())
    # The harness's own keys beside HF's (core/model/config.cpp): HF's Qwen3 always has q/k norms and puts
    # attention_bias on o_proj too; a config that says otherwise describes a model HF cannot build.
    if config.get("model_type") == "qwen3" and (config.get("qk_norm") is False or
                                                config.get("o_proj_bias", config.get("attention_bias")) != config.get("attention_bias")):
        raise CaseError("config.json: qwen3 without qk-norm, or with o_proj_bias != attention_bias, has no HF class")
    model = transformers.AutoModelForCausalLM.from_pretrained(case.dir / "model", dtype=case.dtype,
                                                              attn_implementation="sdpa")
    if getattr(model.config, "attention_dropout", 0.0) != 0.0:
        raise CaseError(f"config.json: attention_dropout {model.config.attention_dropout} makes gradients random")
    model.config.use_cache = False
    if gradient_checkpointing:  # before PEFT: HF's checkpointing lives on the decoder layers of the base model
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()  # non-reentrant torch.utils.checkpoint (HF's default): works with a frozen base under LoRA
        if not any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
            raise CaseError("HF did not turn gradient checkpointing on for this model")
    if case.lora:
        from peft import PeftModel

        adapter_dir = case.dir / "adapter"
        if json.loads((adapter_dir / "adapter_config.json").read_text()).get("lora_dropout", 0.0) != 0.0:
            raise CaseError("adapter_config.json: lora_dropout > 0 makes gradients random")
        # autocast_adapter_dtype=False: PEFT would otherwise hold bf16 adapters in fp32; the case dtype is judged
        model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=True, autocast_adapter_dtype=False)
        trainable = {saved_peft_name(n): p for n, p in model.named_parameters() if p.requires_grad}
        saved = load_file(str(adapter_dir / "adapter_model.safetensors"))
        if set(saved) != set(trainable):  # PEFT only warns on missing/unexpected keys
            raise CaseError(f"adapter: file vs PEFT's trainable tensors differ: {sorted(set(saved) ^ set(trainable))[:6]}")
        wrong = {n: p.dtype for n, p in trainable.items() if p.dtype != case.dtype}
        if wrong:
            raise CaseError(f"adapter: PEFT holds {len(wrong)} tensors in another dtype than {case.dtype}: {wrong}")
    else:
        trainable = dict(model.named_parameters())  # a tied lm_head appears once, as model.embed_tokens.weight
    model.train(gradient_checkpointing)
    return model, trainable


def run_step(case, model, trainable, loss_fn):
    """loss_fn(model, case) -> scalar loss; one forward + backward, timed. A micro-batch case: one per micro-batch
    (loss_fn gets micro_case's Case: its share of the step's loss), the gradients accumulating as a trainer's do.
    Returns (the step's loss, {name: gradient}, seconds)."""
    for p in trainable.values():
        p.grad = None
    start = time.perf_counter()
    loss = 0.0
    for part in [micro_case(case, rows) for rows in case.micro_batches] if case.micro_batches else [case]:
        part_loss = loss_fn(model, part)
        part_loss.backward()
        loss = loss + part_loss.detach()
    seconds = time.perf_counter() - start
    missing = [n for n, p in trainable.items() if p.grad is None]
    if missing:  # e.g. a tensor the loss does not reach: the protocol wants every trainable tensor
        raise CaseError(f"no gradient for {missing[:4]}")
    grads = {n: p.grad.detach().to(case.dtype).contiguous() for n, p in trainable.items()}
    return loss.item(), grads, seconds


def main(argv, loss_fn, usage, accumulates=False, packs=False):
    """The HF adapters' command line, [--gradient-checkpointing] CASE_DIR, on streambp_conform.run (exit 0 with the
    outputs written, 2 a case this adapter cannot run, 3 NotExpressible). `accumulates`: loss_fn normalises a
    micro-batch by the step's totals (Case.union), so micro-batch cases run (run_step); `packs`: loss_fn hands the
    model packed rows' boundaries (losses.forward_logits does), so packed cases run: True SFT's, ("sft", "grpo") also
    packed GRPO's per-sequence terms (streambp_conform.protocol.packed_objectives)."""
    args = [a for a in argv if a != "--gradient-checkpointing"]

    def step(case):
        model, trainable = load_model(case, gradient_checkpointing=len(args) != len(argv))
        loss, grads, seconds = run_step(case, model, trainable, loss_fn)
        return Result(loss, grads, seconds)

    return run(step, args, accumulates=accumulates, usage=usage, packs=packs)
