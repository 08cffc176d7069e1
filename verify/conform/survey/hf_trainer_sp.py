#!/usr/bin/env python3
"""transformers' Trainer on its sequence-parallel path (TrainingArguments.parallelism_config = accelerate's
ParallelismConfig(sp_size=W, sp_backend="deepspeed"), which runs DeepSpeed's Ulysses under its engine) on W Gloo
ranks on the CPU. Usage: hf_trainer_sp.py [--zero=2|3] CASE_DIR

The Trainer as a user configures it: the case's rows as a dataset of input_ids, labels and position_ids (T
right-padded to W's multiple, pad id 0, label -100: Ulysses drops the attention mask and relies on causal sdpa),
per_device_train_batch_size = the case's rows, one step, lr 0, DeepSpeed ZeRO-2 (or --zero) with SP = the case's
ranks (2 for a one-rank case). Accelerate's DeepSpeed SP dataloader shifts and shards the sequence; the Trainer's
loss is deepspeed_sp_compute_loss (each rank's mean, all-gathered and weighted by target counts). The gradient
written is the reduced one DeepSpeed's engine holds at its first optimizer step (deepspeed.utils.safe_get_full_grad,
read in a wrapper of DeepSpeedEngine.step), the loss the one the Trainer's compute_loss returned for it.
HF's loss rounds the logits to fp32 (logits.float()), so fp64 cases also carry that rounding (~1e-8).
DeepSpeed needs its own process-group set-up before the Trainer (deepspeed.init_distributed): accelerate leaves it
to the deepspeed launcher, which torchrun is not.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))  # verify/conform: the streambp_conform package (no torch at import)
from streambp_conform.protocol import declines_rl_step  # noqa: E402
FLAGS = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--") and "=" in a}
ZERO = int(FLAGS.get("--zero", "2"))


def launch(case_dir):
    if (declined := declines_rl_step(case_dir)) is not None:  # before torchrun, which reports a rank's 3 as 1
        return declined
    meta = json.loads((Path(case_dir) / "case.json").read_text())
    why = None
    if (meta.get("objective") or {}).get("name") != "sft":
        why = "the Trainer's SP loss is the model's own (SFT) loss"
    elif meta.get("lora"):
        why = "LoRA: this entry runs the Trainer's full fine-tuning"
    elif meta.get("micro_batches"):
        why = "a step of micro-batches: DeepSpeed's SP dataloader steps once per rank's batch, not run here"
    ranks = int(meta.get("ranks", 1))
    sp = ranks if ranks > 1 else 2
    config = json.loads((Path(case_dir) / "model" / "config.json").read_text())
    heads = (config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"]))
    if heads[0] % sp or (heads[1] % sp and sp % heads[1]):
        why = f"{heads[0]} query / {heads[1]} KV heads on {sp} ranks: Ulysses splits heads"
    if why:  # before any process starts (torchrun reports a rank's exit 3 as 1)
        print(f"{Path(case_dir).name}: {why}", file=sys.stderr)
        return 3
    port = str(29500 + os.getpid() % 2000)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(sp),
           "--master_addr", "127.0.0.1", "--master_port", port, str(HERE), f"--zero={ZERO}", "--worker", case_dir]
    env = dict(os.environ, DS_ACCELERATOR="cpu", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    return subprocess.call(cmd, env=env)


def worker(case_dir):
    import tempfile

    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(HERE.parent))
    import deepspeed_common as ds_common

    ds_common.init_distributed_gloo()
    sys.path.insert(0, str(HERE.parents[1]))
    import protocol
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import safe_get_full_grad
    from transformers import Trainer, TrainingArguments

    rank, sp = torch.distributed.get_rank(), torch.distributed.get_world_size()
    case = protocol.read_case(case_dir, distributed=True, packs=False)
    model, trainable = protocol.load_model(case)
    b = case.batch
    B, T = b["input_ids"].shape
    Tp = math.ceil(T / sp) * sp
    ids = F.pad(b["input_ids"], (0, Tp - T), value=0)
    labels = F.pad(b["labels"], (0, Tp - T), value=-100)
    rows = [{"input_ids": ids[i], "labels": labels[i], "position_ids": torch.arange(Tp)} for i in range(B)]

    seen = []
    step = DeepSpeedEngine.step

    def reading_step(self, *args, **kwargs):  # the reduced gradient, before the optimizer takes it
        if self.is_gradient_accumulation_boundary() and not seen:
            seen.append({n: safe_get_full_grad(p) for n, p in self.module.named_parameters()})
        return step(self, *args, **kwargs)

    losses = []

    class RecordingTrainer(Trainer):  # records the step's loss; computes nothing itself
        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            losses.append(float((loss[0] if isinstance(loss, tuple) else loss).detach()))
            return loss

    DeepSpeedEngine.step = reading_step
    sp_handler = DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa")
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=B, max_steps=1, report_to=[], use_cpu=True,
            learning_rate=0.0, save_strategy="no", max_grad_norm=0.0,
            deepspeed={"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
                       "zero_optimization": {"stage": ZERO}},
            parallelism_config=ParallelismConfig(sp_size=sp, sp_backend="deepspeed", sp_handler=sp_handler))
        RecordingTrainer(model=model, args=args, train_dataset=rows).train()
    if rank == 0:
        grads = {n: seen[0][n] for n in trainable}
        protocol.write_outputs(case, losses[0], {n: g.to(case.dtype).contiguous() for n, g in grads.items()})
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not (a.startswith("--") and "=" in a)]
    if len(args) == 2 and args[0] == "--worker":
        sys.exit(worker(args[1]))
    if len(args) != 1 or args[0].startswith("-"):
        print("Usage: hf_trainer_sp.py [--zero=2|3] CASE_DIR", file=sys.stderr)
        sys.exit(2)
    sys.exit(launch(args[0]))
