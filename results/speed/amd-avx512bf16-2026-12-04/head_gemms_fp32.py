# The three GEMMs of StreamBP's head on qwen3-small in fp32 (one head chunk of 1024 positions, d = 512,
# V = 151936) against a 2048^3 GEMM in the same process, 2 threads, best of 3, GFLOP/s. Run with the harness's venv.
import time
import torch

torch.set_num_threads(2)


def best_seconds(f, n=3):
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return min(ts)


c, d, V = 1024, 512, 151936
h, W, L, G = torch.randn(c, d), torch.randn(V, d), torch.randn(c, V), torch.zeros(V, d)
a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
flops = 2 * c * d * V
cases = {
    "2048^3 mm": (lambda: a @ b, 2 * 2048**3),
    "logits h W^T": (lambda: h @ W.t(), flops),
    "dh = dlogits W": (lambda: L @ W, flops),
    "dW += dlogits^T h": (lambda: G.addmm_(L.t(), h), flops),
}
print("torch", torch.__version__)
for _ in range(2):
    print(", ".join(f"{name} {f / best_seconds(fn) / 1e9:.0f}" for name, (fn, f) in cases.items()))
