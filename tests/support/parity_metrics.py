"""The error metrics every Python oracle script judges with, NaN-proof: a NaN compares false with every bound and
never wins a max(), so a metric that can come out NaN is +inf here (it then fails every gate and is the worst).

normwise_error(ours, ref): max|ours - ref| / max|ref| (ARCHITECTURE.md §8's exactness metric), +inf when either tensor holds a
non-finite entry. finite(x): x, or +inf when x is NaN or infinite (for ratios and loss errors).
low_precision_verdict(...): the harness's low-precision rule, judged by the binary itself (`streambp compare
--baseline`), so that the scripts, the tests, `verify --gate` and `conform` share one implementation of it.
"""
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

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


def low_precision_verdict(binary, oracle, baseline, ours, dtype):
    """The low-precision rule (verify/grad_compare.h) on gradient dicts {name: tensor}: `ours` and `baseline` in
    `dtype` ("fp32", "bf16"), both against the fp64 `oracle`. Returns (worst statistic, its tensor, passed, the
    binary's summary line); a statistic <= 1 passes."""
    from safetensors.torch import save_file
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for name, grads in (("oracle", oracle), ("baseline", baseline), ("ours", ours)):
            files.append(Path(tmp) / f"{name}.safetensors")
            save_file({k: v.detach().contiguous() for k, v in grads.items()}, str(files[-1]))
        p = subprocess.run([binary, "compare", str(files[0]), str(files[2]), "--baseline", str(files[1]), "--dtype", dtype],
                           capture_output=True, text=True)
    lines = p.stdout.strip().splitlines()
    summary = lines[-1] if lines else p.stderr.strip()
    m = re.search(r"worst ([0-9.einf+-]+) of the allowance in (\S+)", summary)
    if p.returncode not in (0, 1) or not m:
        raise SystemExit(f"streambp compare --baseline failed (exit {p.returncode}): {p.stdout}{p.stderr}")
    return finite(m.group(1)), m.group(2), p.returncode == 0, summary


def with_fault(grads):
    """The scripts' negative control (CTest <script>_fault): with STREAMBP_PARITY_FAULT=EPS in the environment, the
    gradients read from our binary come back with the last tensor (by name) scaled by 1 + EPS, and the script must
    fail its gate. Without it, `grads` unchanged."""
    eps = os.environ.get("STREAMBP_PARITY_FAULT")
    if not eps:
        return grads
    name = sorted(grads)[-1]
    grads = dict(grads)
    grads[name] = grads[name] * (1 + float(eps))
    print(f"fault injected: {name} x (1 + {eps})")
    return grads


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


def stop_if_fault_run():
    """Called after a failure is printed: a negative control's run (STREAMBP_PARITY_FAULT or STREAMBP_TRL_FAULT set)
    has shown what it must at its first failure, so it stops there instead of walking the rest of the matrix."""
    if os.environ.get("STREAMBP_PARITY_FAULT") or os.environ.get("STREAMBP_TRL_FAULT"):
        sys.exit(1)


def run_cases(cases, check):
    """Each case (name, args) through check(name, args), which returns its failures: they are printed and a fault run
    stops at the first (stop_if_fault_run). Returns the script's exit code, 1 when any case failed."""
    failures = []
    for name, args in cases:
        found = check(name, args)
        for f in found:
            print("FAIL:", f)
        if found:
            stop_if_fault_run()
        failures += found
    return 1 if failures else 0
