"""transformers' Trainer with sequence parallelism (accelerate ParallelismConfig, sp_backend="deepspeed") under ZeRO-2:
the gradient DeepSpeed's engine hands its optimizer is sp_size times the one-process gradient of the same loss.
W = SP Gloo ranks (2, or 3) on the CPU, fp64, a 1-layer untied Llama; lr 0; ACCUM micro-batches (1 row each) in the
step. Rank 0 prints each tensor's multiple of the reference: one process's gradient of the step's union batch.
  DS_ACCELERATOR=cpu ZERO=2 SP=2 ACCUM=1 python -m torch.distributed.run --nproc_per_node=2 \
    transformers_trainer_sp_zero2.py
(ZERO=3: every tensor x1; ZERO=3 REDUCE_SCATTER=0, zero_optimization's "reduce_scatter": false: x SP again.)"""
import os
import tempfile

import deepspeed
import torch

W, K = int(os.environ.get("SP", "2")), int(os.environ.get("ACCUM", "1"))
ZERO = {"stage": int(os.environ.get("ZERO", "2"))}
for knob in ("reduce_scatter", "contiguous_gradients"):  # REDUCE_SCATTER=0 etc.; unset: DeepSpeed's default, true
    if knob.upper() in os.environ:
        ZERO[knob] = os.environ[knob.upper()] == "1"
LABEL = " ".join([f"ZeRO-{ZERO['stage']}"] + [f"{k}={v}" for k, v in ZERO.items() if k != "stage"])
deepspeed.init_distributed(dist_backend="gloo")  # the Trainer expects DeepSpeed's process groups to exist
from accelerate.utils import ParallelismConfig  # noqa: E402
from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig  # noqa: E402
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402
from deepspeed.utils import safe_get_full_grad  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=6, num_key_value_heads=6, tie_word_embeddings=False)).double()
ids = torch.randint(1, 64, (K, 24), generator=torch.Generator().manual_seed(1))
labels = ids.clone()
labels[:, :5] = -100
labels[0, 15:] = -100  # uneven target counts over the shards and the micro-batches
references = {}
for kind, parts in (("union", [slice(0, K)]), ("micro-means", [slice(i, i + 1) for i in range(K)])):
    for part in parts:  # the union batch's mean loss; the mean of the micro-batches' means (K > 1); one process
        (model(input_ids=ids[part], labels=labels[part]).loss / len(parts)).backward()
    references[kind] = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

seen, step = [], DeepSpeedEngine.step


def reading_step(self, *args, **kwargs):  # the reduced gradient, as the optimizer is about to take it
    seen.append({n: safe_get_full_grad(p).clone() for n, p in self.module.named_parameters()})
    return step(self, *args, **kwargs)


DeepSpeedEngine.step = reading_step
rows = [{"input_ids": ids[i], "labels": labels[i], "position_ids": torch.arange(24)} for i in range(K)]
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=1, max_steps=1, gradient_accumulation_steps=K, report_to=[],
        use_cpu=True, learning_rate=0.0, save_strategy="no",
        deepspeed={"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": K,
                   "zero_optimization": ZERO},
        parallelism_config=ParallelismConfig(sp_size=W, sp_backend="deepspeed",
                                             sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa")))
    Trainer(model=model, args=args, train_dataset=rows).train()
if torch.distributed.get_rank() == 0:
    for kind in references if K > 1 else ["union"]:
        for name, ref in references[kind].items():
            factor = (seen[0][name].norm() / ref.norm()).item()
            residual = ((seen[0][name] - factor * ref).norm() / seen[0][name].norm()).item()
            print(f"{LABEL} W={W} K={K} vs {kind} {name}: x{factor:.6f} "
                  f"(residual {residual:.1e})")
