#!/usr/bin/env python3
"""Conformance adapter (protocol streambp-conform/1) for the paper's official StreamBP code, github.com/Ledzy/StreamBP
at commit 3b56c16921c62a68e2f6f5b32abb2b0aa80a36c7, installed as its README says (`pip install -e .` of a checkout: the
survey's venv, experiments/survey/implementations.json; pins: transformers 4.51.3, peft 0.15.1, trl 0.17.0; torch
2.14.1 here instead of 2.6.0).

Usage: official_streambp.py CASE_DIR

It calls the official code as documented (README "Use StreamBP in your own training pipeline", scripts/test_sft.py,
tests/test_grad_correctness.py) and copies none of it:
    model = StreamModel(hf_model, gradient_accumulation_steps=1, logits_chunk_size=chunks.head,
                        stream_checkpoint=True, checkpoint_chunk_size=chunks.layer)
    model.gradient_checkpointing_enable()
    [LoRA: model = get_peft_model(model, LoraConfig) -- PEFT wraps the StreamModel, as scripts/test_sft.py does, but
     with gradient_checkpointing_enable() after get_peft_model: the documented order raises NotImplementedError
     under the pinned peft 0.15.1 (see build()); the saved adapter's tensors are copied in by name]
    model.train(); out = model(input_ids, attention_mask, labels, use_cache=False, return_dict=True)
StreamModel.forward runs the backward itself (the loss it returns is detached; the trainers replace
accelerator.backward by a no-op), so the gradients are read from .grad after the call.

Objectives: SFT as above. GRPO through the documented trainer (README step 1: "replace the trainer with
StreamGRPOTrainer"): a real streambp.StreamGRPOTrainer (TRL 0.17 GRPOTrainer subclass) is constructed around the
StreamModel with a GRPOConfig carrying case.json's values, and its own loss method, trainer._compute_loss(model, inputs),
runs the fused forward+backward on TRL's input layout (prompt_ids/prompt_mask, completion_ids/completion_mask,
advantages, old_per_token_logps, ref_per_token_logps), split from the case's rows at their common prompt length.
Cases with no counterpart in TRL 0.17 / StreamBP (sequence-level importance sampling; rows whose prompts differ in
length or whose completion mask is not their attention mask there) are not expressible (exit 3 with the reason);
everything else, including loss types the official code rejects (dapo) and beta = 0, is passed through so the
official code answers itself. DPO is not expressible (the reason in NOT_EXPRESSIBLE).

fp64: the harness judges fp64 at 1e-10 against an exact fp64 oracle. Two roundings to fp32 inside *HF transformers
4.51.3* (not StreamBP) would put every fp64 case ~1e-7 off on their own: RMSNorm's `.to(torch.float32)` and
ForCausalLMLoss's `logits.float()`. In fp64 cases only, this adapter applies the same two precision patches as the
harness's own HF adapter: protocol.fp64_exact (RMSNorm in at least fp32) and an HF causal-LM loss
without the fp32 cast, set as the HF model's `loss_function` (which StreamModel.forward calls per chunk).
Set STREAMBP_NO_FP64_PATCHES=1 to run HF 4.51.3 exactly as shipped.
"""
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import protocol  # noqa: E402  (read_case, quiet_hf, fp64_exact, saved_peft_name, write_outputs)
from protocol import CaseError, NotExpressible  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

NOT_EXPRESSIBLE = {
    "dpo": "the official DPO exists only as StreamDPOTrainer._fused_dpo_backward, a TRL 0.17 DPOTrainer method that "
           "cannot take precomputed reference log-probs (the case's ref_logps): it recomputes them by applying the "
           "reference model's (or the adapter-disabled policy's) lm_head to the *policy's* hidden states "
           "(src/streambp/trainers/stream_dpo_trainer.py:72,76), never scores the first completion token (label slices "
           "start at prompt_len + 1, lines 68-69 and 126-128), has no label smoothing, and returns -logsigmoid(c) "
           "without beta as the loss (line 81)",
}


def hf_causal_lm_loss_keeping_fp64(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                                    shift_labels=None, **kwargs):
    """transformers 4.51.3 ForCausalLMLoss with `logits.float()` replaced by an upcast to *at least* fp32 (fp64 stays
    fp64). Same shift (pad -100, drop the first) and HF's own fixed_cross_entropy."""
    from transformers.loss.loss_utils import fixed_cross_entropy

    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
    return fixed_cross_entropy(logits.view(-1, vocab_size), shift_labels.view(-1).to(logits.device),
                               num_items_in_batch, ignore_index, **kwargs)


def unwrap_stream_names(name):
    """StreamModel wraps each decoder layer (StreamDecoderLayer.base_layer) and its attention
    (StreamAttention.self_attn); the HF name has neither."""
    return name.replace(".base_layer.self_attn.self_attn.", ".self_attn.").replace(".base_layer.mlp.", ".mlp.") \
               .replace(".base_layer.input_layernorm.", ".input_layernorm.") \
               .replace(".base_layer.post_attention_layernorm.", ".post_attention_layernorm.")


def stream_to_hf_name(name):
    """StreamModel.model is the HF CausalLM: model.model.layers.0.base_layer.self_attn.self_attn.q_proj.weight ->
    model.layers.0.self_attn.q_proj.weight."""
    assert name.startswith("model."), name
    return unwrap_stream_names(name[len("model."):])


def stream_peft_to_saved_name(name):
    """PEFT wrapping the StreamModel names an adapter
       base_model.model.model.model.layers.0.base_layer.self_attn.self_attn.q_proj.lora_A.default.weight
    (PeftModel > LoraModel > StreamModel.model > HF CausalLM .model > layers.i = StreamDecoderLayer.base_layer >
    self_attn = StreamAttention.self_attn); the saved adapter (plain HF + PEFT) has
       base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight."""
    assert name.startswith("base_model.model.model.model."), name
    name = "base_model.model." + name[len("base_model.model.model."):]
    return protocol.saved_peft_name(unwrap_stream_names(name))


def grpo_case_to_trl(case):
    """The case's rows as TRL 0.17 GRPOTrainer's _compute_loss inputs. TRL concatenates [prompt_ids | completion_ids]
    with one prompt length P for the batch and uses [prompt_mask | completion_mask] as the attention mask; the case's
    rows (right padding) map onto that exactly when every row's completion starts at the same P, the prompt has no
    padding, and the completion mask equals the attention mask from P on. old_logps/ref_logps [B, T] hold the log-prob
    of token t at entry t, so the completion's columns are [:, P:]."""
    b, o = case.batch, case.objective
    if o.get("importance_sampling_level", "token") != "token":
        raise NotExpressible("grpo: importance_sampling_level 'sequence' has no counterpart in TRL 0.17's GRPOConfig or in "
                        "StreamGRPOTrainer._compute_loss (token-level ratios only, stream_grpo_trainer.py:161)")
    cm, am = b["completion_mask"], b["attention_mask"]
    first = [int(r.nonzero()[0]) if r.any() else -1 for r in cm]
    P = first[0]
    if any(f != P for f in first) or P < 1:
        raise NotExpressible(f"grpo: completions start at {first}; TRL's layout needs one prompt length")
    if not bool((am[:, :P] == 1).all()) or not torch.equal(cm[:, P:], am[:, P:]):
        raise NotExpressible("grpo: prompt padding or a completion mask that differs from the attention mask")
    dt = case.dtype if case.dtype == torch.float64 else torch.float32  # TRL keeps these in fp32
    inputs = {"prompt_ids": b["input_ids"][:, :P], "prompt_mask": am[:, :P],
              "completion_ids": b["input_ids"][:, P:], "completion_mask": cm[:, P:],
              "advantages": b["advantages"].to(dt)}
    if "old_logps" in b:
        inputs["old_per_token_logps"] = b["old_logps"][:, P:].to(dt)
    if "ref_logps" in b:
        inputs["ref_per_token_logps"] = b["ref_logps"][:, P:].to(dt)
    return inputs


def make_grpo_trainer(case, model):
    """A real streambp.StreamGRPOTrainer (the README's replacement for TRL's GRPOTrainer) around the StreamModel."""

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig
    from streambp import StreamGRPOTrainer

    o, b = case.objective, case.batch
    B = b["input_ids"].size(0)
    if case.lora:
        raise NotExpressible("grpo under LoRA: this adapter wires the full model only")
    vocab = model.config.vocab_size
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")),
                                  pad_token="t0", eos_token="t1")  # the case ships no tokenizer; GRPOTrainer wants one
    max_len = int(o.get("max_completion_length") or b["input_ids"].size(1))
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="trl-"),  # save_strategy "no": nothing is written
                      report_to="none", use_cpu=True,
                      bf16=False, beta=float(o.get("beta", 0.0)), epsilon=float(o.get("epsilon", 0.2)),
                      epsilon_high=o.get("epsilon_high"), loss_type=o.get("loss_type", "bnpo"),
                      temperature=float(o.get("temperature", 1.0)), max_completion_length=max_len,
                      # TRL uses old_per_token_logps only when num_iterations > 1 (else the detached current logps)
                      num_iterations=2 if "old_logps" in b else 1,
                      num_generations=B, per_device_train_batch_size=B, save_strategy="no", logging_strategy="no")

    def zero_reward(completions, **kwargs):
        return [0.0] * len(completions)

    trainer = StreamGRPOTrainer(model=model, reward_funcs=zero_reward, args=args, processing_class=tok,
                                max_completion_length=max_len)
    model.train()
    return trainer


def build(case, meta):
    import transformers
    from streambp import StreamModel

    protocol.quiet_hf()
    fp64_patches = case.dtype == torch.float64 and os.environ.get("STREAMBP_NO_FP64_PATCHES") != "1"
    if fp64_patches:
        protocol.fp64_exact()
    hf = transformers.AutoModelForCausalLM.from_pretrained(case.dir / "model", torch_dtype=case.dtype,
                                                           attn_implementation="sdpa")
    if getattr(hf.config, "attention_dropout", 0.0) != 0.0:
        raise CaseError("attention_dropout > 0 makes gradients random")
    hf.config.use_cache = False
    if fp64_patches:
        hf.loss_function = hf_causal_lm_loss_keeping_fp64  # PreTrainedModel.loss_function's setter (4.51.3)
    hf.train()  # scripts/test_sft.py: base_model.train() before wrapping

    chunks = meta.get("chunks") or {}
    T = case.batch["input_ids"].size(1)
    # --- the documented usage (README step 2) ---
    model = StreamModel(hf, gradient_accumulation_steps=1, logits_chunk_size=int(chunks.get("head") or T),
                        stream_checkpoint=True, checkpoint_chunk_size=int(chunks.get("layer") or T))
    if not case.lora:
        model.gradient_checkpointing_enable()
        model.train()
        # a tied lm_head is the same Parameter as model.embed_tokens.weight and appears once
        trainable = {stream_to_hf_name(n): p for n, p in model.named_parameters()}
        return model, trainable
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    adapter_dir = case.dir / "adapter"
    lcfg = LoraConfig.from_pretrained(str(adapter_dir))
    if lcfg.lora_dropout != 0.0:
        raise CaseError("lora_dropout > 0 makes gradients random")
    lcfg.inference_mode = False
    # scripts/test_sft.py --use_lora calls model.gradient_checkpointing_enable() and *then* get_peft_model(model, ...).
    # With the pinned peft 0.15.1 that order raises NotImplementedError: PEFT sees is_gradient_checkpointing and calls
    # StreamModel.enable_input_require_grads() -> PreTrainedModel.get_input_embeddings() on the wrapper, which has no
    # base_model_prefix (peft_model.py:142 -> :650 -> transformers modeling_utils.py:2393 -> :2412). So PEFT wraps
    # first and StreamModel.gradient_checkpointing_enable() runs after, reached through PEFT's attribute forwarding.
    # STREAMBP_DOCUMENTED_LORA_ORDER=1 keeps the documented order (and shows the error).
    if os.environ.get("STREAMBP_DOCUMENTED_LORA_ORDER") == "1":
        model.gradient_checkpointing_enable()
    model = get_peft_model(model, lcfg, autocast_adapter_dtype=False)
    if os.environ.get("STREAMBP_DOCUMENTED_LORA_ORDER") != "1":
        model.gradient_checkpointing_enable()  # PeftModel -> LoraModel -> StreamModel.gradient_checkpointing_enable
    if not any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
        raise CaseError("StreamModel's stream checkpointing is not on")
    saved = load_file(str(adapter_dir / "adapter_model.safetensors"))
    trainable = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            trainable[stream_peft_to_saved_name(n)] = p
    if set(trainable) != set(saved):
        raise CaseError(f"adapter names differ: {sorted(set(trainable) ^ set(saved))[:6]}")
    with torch.no_grad():
        for n, p in trainable.items():
            p.data = saved[n].to(case.dtype).clone()
    model.train()
    return model, trainable


def run(argv):
    if len(argv) != 1 or argv[0].startswith("-"):
        print("Usage: official_streambp.py CASE_DIR", file=sys.stderr)
        return 2
    try:
        case = protocol.read_case(argv[0], packs=False)  # packed rows: not declared
        meta = json.loads((case.dir / "case.json").read_text())
        name = case.objective["name"]
        if case.ranks != 1:
            raise NotExpressible(f"{case.ranks} ranks: this adapter runs one process")
        if name in NOT_EXPRESSIBLE:
            raise NotExpressible(f"{name}: {NOT_EXPRESSIBLE[name]}")
        if name == "sft" and "labels" not in case.batch:
            raise CaseError("sft: batch.safetensors has no 'labels'")
        if name == "grpo":
            grpo_inputs = grpo_case_to_trl(case)  # refuse unmappable cases before building anything
        model, trainable = build(case, meta)
        for p in trainable.values():
            p.grad = None
        b = case.batch
        if name == "grpo":
            trainer = make_grpo_trainer(case, model)
            start = time.perf_counter()
            loss = trainer._compute_loss(model, grpo_inputs)  # the fused forward + backward (stream_grpo_trainer.py:122)
            seconds = time.perf_counter() - start
        else:
            start = time.perf_counter()
            out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"],
                        use_cache=False, return_dict=True)
            if out.loss.requires_grad:  # as tests/test_grad_correctness.py: the backward already ran inside forward
                out.loss.backward()
            seconds = time.perf_counter() - start
            loss = out.loss
        missing = [n for n, p in trainable.items() if p.grad is None]
        if missing:
            raise CaseError(f"no gradient for {missing[:4]}")
        grads = {n: p.grad.detach().to(case.dtype).contiguous() for n, p in trainable.items()}
    except CaseError as e:
        print(f"{Path(argv[-1]).name}: {e}", file=sys.stderr)
        return 2
    except NotExpressible as e:
        print(f"{Path(argv[-1]).name}: {e}", file=sys.stderr)
        return protocol.NOT_EXPRESSIBLE
    protocol.write_outputs(case, float(loss.item()), grads, seconds)
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
