"""The error metrics every Python oracle script judges with, NaN-proof: a NaN compares false with every bound and
never wins a max(), so a metric that can come out NaN is +inf here (it then fails every gate and is the worst).

normwise_error(ours, ref): max|ours - ref| / max|ref| (DESIGN §8's exactness metric), +inf when either tensor holds a
non-finite entry. finite(x): x, or +inf when x is NaN or infinite (for ratios and loss errors).
"""
import math

import torch


def finite(x):
    x = float(x)
    return x if math.isfinite(x) else math.inf


def normwise_error(ours, ref):
    ours, ref = ours.to(torch.float64), ref.to(torch.float64)
    if not (torch.isfinite(ours).all() and torch.isfinite(ref).all()):
        return math.inf
    scale = ref.abs().max().item()
    diff = (ours - ref).abs().max().item()
    return diff / scale if scale > 0 else (math.inf if diff > 0 else 0.0)


def check():
    """The metrics' own negative controls (CTest parity_metrics): a NaN or Inf anywhere is the worst error."""
    ref = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    assert normwise_error(ref.clone(), ref) == 0.0
    assert normwise_error(ref * (1 + 1e-12), ref) < 1e-11
    for poison in (math.nan, math.inf, -math.inf):
        bad = ref.clone()
        bad[1] = poison
        assert normwise_error(bad, ref) == math.inf, poison
        assert normwise_error(ref, bad) == math.inf, poison
        assert finite(poison) == math.inf
    errors = {"a": 1e-13, "b": finite(math.nan), "c": 2e-13}
    assert max(errors, key=errors.get) == "b"  # a NaN is never hidden behind a finite error
    print("ok: NaN and Inf are the worst error, in tensors and in scalars")


if __name__ == "__main__":
    check()
