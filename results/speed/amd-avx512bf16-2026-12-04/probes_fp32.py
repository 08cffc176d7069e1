# Two probes of the fp32 step's largest pieces on qwen3-small, each against a 2048^3 fp32 GEMM in the same process
# (2 threads; on a shared guest only the ratios mean anything). Run with the harness's venv python (torch 2.14.1):
#   flash: ATen's CPU flash attention, the block shape of the fp32 chunk attention (8 heads, 512 queries,
#          4096 keys, head_dim 64, no mask), medians of 5;
#   head:  the three GEMMs of StreamBP's head (one chunk of 1024 positions, d = 512, V = 151936), best of 3.
import time
import torch

torch.set_num_threads(2)


def seconds(f, n, pick):
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return pick(sorted(ts))


def median(ts):
    return ts[len(ts) // 2]


a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
mm_flops = 2 * 2048**3
print("torch", torch.__version__)

B, H, c, n, hd = 1, 8, 512, 4096, 64
q, k, v = (torch.randn(B, H, m, hd) for m in (c, n, n))
forward = lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=0.125)
o, lse = forward()
do = torch.randn_like(o)
backward = lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
    do, q, k, v, o, lse, 0.0, False, scale=0.125)
fwd_flops = 2 * 2 * B * H * c * n * hd  # S = Q K^T and O = P V
bwd_flops = 2.5 * fwd_flops  # S again, dP, dV, dQ, dK
for _ in range(2):
    tf, tb, tm = (seconds(f, 5, median) for f in (forward, backward, lambda: a @ b))
    print(f"flash forward {fwd_flops / tf / 1e9:.0f} GFLOP/s, backward {bwd_flops / tb / 1e9:.0f}, "
          f"2048^3 mm {mm_flops / tm / 1e9:.0f}")

c, d, V = 1024, 512, 151936
h, W, L, G = torch.randn(c, d), torch.randn(V, d), torch.randn(c, V), torch.zeros(V, d)
flops = 2 * c * d * V
cases = {
    "2048^3 mm": (lambda: a @ b, mm_flops),
    "logits h W^T": (lambda: h @ W.t(), flops),
    "dh = dlogits W": (lambda: L @ W, flops),
    "dW += dlogits^T h": (lambda: G.addmm_(L.t(), h), flops),
}
for _ in range(2):
    print(", ".join(f"{name} {f / seconds(fn, 3, min) / 1e9:.0f}" for name, (fn, f) in cases.items()))
