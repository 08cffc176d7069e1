#!/usr/bin/env python3
"""transformers' Trainer on its sequence-parallel path (TrainingArguments.parallelism_config: accelerate's
ParallelismConfig with sp_backend "deepspeed", DeepSpeed's Ulysses) on 2 Gloo ranks on the CPU: the reduced gradient
DeepSpeed's engine holds at its first optimizer step, against one process's gradient of the same row's mean loss.
docs/survey.md quotes its answer; the survey has no Trainer-SP entry yet (issue #45).

Usage (the survey's DeepSpeed venv, which sees the harness's transformers and accelerate):
  DS_ACCELERATOR=cpu ZERO=2 ~/.cache/streambp/survey/deepspeed-0.19.8/bin/python -m torch.distributed.run \
      --nproc_per_node=2 experiments/survey/trainer_sp_gloo_probe.py
Rank 0 prints, per tensor, |g| / |g_ref| and the residual after that scale. A tiny untied Llama in fp64, 2 rows of
16 tokens with uneven targets; lr 0, so the step changes nothing. The Trainer needs DeepSpeed's own process-group
set-up before it starts (deepspeed.init_distributed: accelerate leaves it to the launcher).
"""
import os
import tempfile

import deepspeed
import torch

deepspeed.init_distributed(dist_backend="gloo")

from accelerate.utils import ParallelismConfig  # noqa: E402
from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig  # noqa: E402
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402
from deepspeed.utils import safe_get_full_grad  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402


def main():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).double()
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :5] = -100
    labels[0, 12:] = -100  # the two shards of row 0 hold 3 and 4 targets
    # the oracle first: Ulysses, once registered, replaces sdpa for every model in the process
    model(input_ids=ids[:1], labels=labels[:1]).loss.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    seen = []
    step = DeepSpeedEngine.step

    def reading_step(self, *args, **kwargs):  # the reduced gradient, before the optimizer takes it
        if self.is_gradient_accumulation_boundary():
            seen.append({n: safe_get_full_grad(p).clone() for n, p in self.module.named_parameters()})
        return step(self, *args, **kwargs)

    DeepSpeedEngine.step = reading_step
    sp_handler = DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa")
    rows = [{"input_ids": ids[i], "labels": labels[i], "position_ids": torch.arange(16)} for i in range(2)]
    out = tempfile.TemporaryDirectory()  # the Trainer's output_dir; it saves nothing (save_strategy "no")
    args = TrainingArguments(
        output_dir=out.name, per_device_train_batch_size=1,
        max_steps=1, report_to=[], use_cpu=True, learning_rate=0.0, save_strategy="no",
        deepspeed={"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                   "zero_optimization": {"stage": int(os.environ.get("ZERO", "2"))}},
        parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed", sp_handler=sp_handler))
    Trainer(model=model, args=args, train_dataset=rows).train()
    out.cleanup()
    if torch.distributed.get_rank() == 0:
        got = seen[0]
        for name, ref in reference.items():
            factor = (got[name].norm() / ref.norm()).item()
            residual = ((got[name] - factor * ref).norm() / got[name].norm()).item()
            print(f"{name}: x{factor:.6f} (residual {residual:.1e})")


if __name__ == "__main__":
    main()
