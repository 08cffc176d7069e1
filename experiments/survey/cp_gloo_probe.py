#!/usr/bin/env python3
"""Does torch's context parallelism run on Gloo ranks on the CPU? The survey's torchtitan-context-parallel row quotes
this probe's answer (torchtitan's CP for SDPA attention is torch's context_parallel dispatcher).

Usage: torchrun --nproc_per_node=2 experiments/survey/cp_gloo_probe.py
Each rank prints "ran" or the exception that stopped causal SDPA under context_parallel; exit 1 if any rank stopped."""
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel


def main():
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    x = torch.randn(1, 2, 16, 8, dtype=torch.float64)  # [B, heads, T, head_dim]: the buffer CP shards along T
    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    try:
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[2]):
            F.scaled_dot_product_attention(x @ w, x, x, is_causal=True).sum().backward()
        print(f"rank {dist.get_rank()}: ran (torch {torch.__version__})", flush=True)
        status = 0
    except Exception as e:  # noqa: BLE001  the answer is the exception
        print(f"rank {dist.get_rank()}: torch {torch.__version__}: {type(e).__name__}: {e}", flush=True)
        status = 1
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
