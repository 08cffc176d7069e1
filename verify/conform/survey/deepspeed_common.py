"""Shared by the DeepSpeed ALST survey adapters (deepspeed_tiled.py, deepspeed_tiled_loss_old.py): the harness's adapter protocol
(verify/conform/protocol.py, imported, not copied) plus DeepSpeed's TiledMLP on every decoder MLP.

TiledMLP is applied the way ArcticTraining does it (arctic_training/model/tiled_compute.py: monkey-patch the HF
`<Prefix>MLP.forward` class method with a function that calls `TiledMLP.apply(fn, self, x, num_shards,
compute_params)`), except that
  - num_shards = ceil(seqlen / tile), tile = DS_MLP_TILE if set, else case.json's chunks.layer (16 in the quick set:
    T = 37 makes 3 tiles, the last short), instead of ArcticTraining's ceil(seqlen / hidden); there is one process
    (deepspeed_ulysses.py: every rank sees the same shard length), so no all_reduce(MAX) of num_shards across ranks;
  - fn is HF's own (unpatched) MLP forward, saved before patching, instead of a re-typed copy of it.
Environment: DS_MLP_TILE (tokens per TiledMLP shard), DS_STATS=1 (print the tiling actually done to stderr).
"""
import math
import os
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import protocol  # noqa: E402  (read_case, load_model, run_step, write_outputs, main)

MLP_TILE = int(os.environ.get("DS_MLP_TILE", "0")) or None  # None: case.json's chunks.layer (configure)
STATS = Counter()


def configure(case):
    """Called at the start of the loss function (protocol.main reads the case): the MLP tile from the case."""
    global MLP_TILE
    if MLP_TILE is None:
        MLP_TILE = int(getattr(case, "layer_chunk", 0) or 16)


def init_distributed_gloo():
    """deepspeed.init_distributed(dist_backend="gloo"), without DeepSpeed's shared-memory all-reduce op.

    On the CPU accelerator DeepSpeed's TorchBackend JIT-compiles that op (ShareMemCommBuilder) the first time a process
    group is made: about two CPU-minutes of a 2-core machine, once per fresh ~/.cache/torch_extensions. Only
    dist.inference_all_reduce calls it (0.17.x-0.19.x); a training step's all_reduce, reduce_scatter and all_gather
    are torch.distributed's on Gloo either way. Marking the op incompatible, which is what DeepSpeed itself does where
    the op cannot build, leaves every collective these adapters run unchanged.
    """
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")


def not_expressible(msg):
    """Exit 3: the case is reported as not expressible, neither passed nor failed."""
    raise protocol.NotExpressible(msg)


def patch_mlps_with_tiled_mlp(TiledMLP):
    import importlib

    for module, cls_name in (("qwen3", "Qwen3MLP"), ("qwen2", "Qwen2MLP"), ("llama", "LlamaMLP")):
        cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls_name)
        if getattr(cls, "_ds_tiled", False):
            continue
        hf_forward = cls.forward

        def tiled_forward(self, x, _hf_forward=hf_forward):
            seqlen = x.shape[-2]
            num_shards = max(1, math.ceil(seqlen / MLP_TILE))
            # the MLP's weights (PEFT: the frozen base weights; TiledMLP keeps only those that require grad)
            compute_params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
            STATS["mlp_calls"] += 1
            STATS["mlp_shards"] += num_shards
            return TiledMLP.apply(_hf_forward, self, x, num_shards, compute_params)

        cls.forward = tiled_forward
        cls._ds_tiled = True


def causal_lm_of(model, case):
    """The HF *ForCausalLM module (under PEFT the wrapped one: LoRA layers are already injected into it)."""
    return model.get_base_model() if case.lora else model


def loss_dtype(dtype):
    """HF's loss upcast (logits.float()) without narrowing fp64 (as verify/conform/losses.py)."""
    return torch.promote_types(dtype, torch.float32)


def shift(labels):
    return torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]  # [B, T]: position t's target is token t+1


def report_stats():
    if os.environ.get("DS_STATS"):
        print(f"ds-survey tiling: {dict(STATS)}", file=sys.stderr)
