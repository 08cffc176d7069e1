# ATen's CPU flash attention in fp32 against a 2048^3 fp32 GEMM in the same process: qwen3-small's block shape
# (8 heads, 512 queries, 4096 keys, head_dim 64, no mask), 2 threads, medians of 5. Only the ratios mean anything
# on a shared guest. Run with the harness's venv python (torch 2.14.1).
import time
import torch

torch.set_num_threads(2)


def median_seconds(f, n=5):
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2]


B, H, c, n, hd = 1, 8, 512, 4096, 64
q, k, v = (torch.randn(B, H, m, hd) for m in (c, n, n))
forward = lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=0.125)
o, lse = forward()
do = torch.randn_like(o)
backward = lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
    do, q, k, v, o, lse, 0.0, False, scale=0.125)
a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
fwd_flops = 2 * 2 * B * H * c * n * hd  # S = Q K^T and O = P V
bwd_flops = 2.5 * fwd_flops  # S again, dP, dV, dQ, dK
print("torch", torch.__version__)
for _ in range(2):
    tf, tb, tm = median_seconds(forward), median_seconds(backward), median_seconds(lambda: a @ b)
    print(f"flash forward {fwd_flops / tf / 1e9:.0f} GFLOP/s, backward {bwd_flops / tb / 1e9:.0f}, "
          f"2048^3 mm {2 * 2048**3 / tm / 1e9:.0f}")
