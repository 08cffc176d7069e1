#!/usr/bin/env python3
"""DeepSpeed's TiledFusedLogitsLoss with output_reduction="sum" and the output then divided by the target count N
(the docstring's advice for uneven tiles, and ArcticTraining's SFT trainer at SP > 1): the lm_head gradient comes
out N times too large, the hidden states' gradient is right. DeepSpeed alone, CPU, fp64:
    pip install deepspeed==0.19.8 torch; DS_ACCELERATOR=cpu python deepspeed_tiled_fused_logits_loss_head.py
"""
import torch
import torch.nn.functional as F
from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

torch.manual_seed(0)
B, T, H, V, SHARDS = 2, 37, 16, 50, 3
head = torch.nn.Module()
head.lm_head = torch.nn.Linear(H, V, bias=False, dtype=torch.float64)
x = torch.randn(B, T, H, dtype=torch.float64, requires_grad=True)  # the final hidden states
y = torch.randint(0, V, (B, T))
y[0, :10] = -100  # a masked prompt: the tiles hold different target counts
y[1, 30:] = -100
N = int((y != -100).sum())


def grads(loss):
    head.lm_head.weight.grad, x.grad = None, None
    loss().backward()
    return head.lm_head.weight.grad.clone(), x.grad.clone()


def plain():  # the reference: the mean CE over the batch's targets, in one piece
    return F.cross_entropy(head.lm_head(x).flatten(0, 1), y.flatten(), ignore_index=-100)


def tile_sum(self, xs, ys):  # a tile's CE sum (0 for a tile without targets)
    return F.cross_entropy(self.lm_head(xs), ys, ignore_index=-100, reduction="sum")


def sum_then_divide():  # the docstring's "use sum and perform the balanced mean to the output"
    w = [head.lm_head.weight]
    return TiledFusedLogitsLoss.apply(tile_sum, head, x, y, None, SHARDS, w, "sum") / N


def divide_inside():  # the same loss with N inside the tile function: exact
    fn = lambda self, xs, ys: tile_sum(self, xs, ys) / N  # noqa: E731
    return TiledFusedLogitsLoss.apply(fn, head, x, y, None, SHARDS, [head.lm_head.weight], "sum")


def factor(g, r):  # the least-squares multiple of the reference
    return float((g * r).sum() / (r * r).sum())


ref_w, ref_x = grads(plain)
# s: the upstream gradient; DeepSpeed's engine multiplies each micro-batch's loss by 1/gradient_accumulation_steps
for name, loss, s in (("sum, then / N", sum_then_divide, 1), ("the same x 1/2", sum_then_divide, 0.5),
                      ("/ N inside fn", divide_inside, 1)):
    w, gx = grads(lambda: loss() * s)
    print(f"{name:14s} N = {N}: lm_head x{factor(w, s * ref_w):.6g}, hidden states x{factor(gx, s * ref_x):.6g}, "
          f"loss {loss().item():.15g} (reference {plain().item():.15g})")
