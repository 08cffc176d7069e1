#!/usr/bin/env python3
"""Each tensor of an implementation's gradients as a multiple of HF's standard BP on the same case (README "The
survey": the factors of a scale bug). CASE_DIR is a case conform kept (`--work DIR`) with the implementation's
grads.safetensors in it; HF's adapter runs on a one-rank copy (the oracle is one process). Prints per tensor the
least-squares factor k (g ~ k g_hf) and what k leaves (||g - k g_hf|| / ||g||: 0 for a pure scale).

Usage: tensor_factors.py CASE_DIR   (the harness venv's python)
"""
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from safetensors.torch import load_file

ADAPTER = Path(__file__).resolve().parents[2] / "verify" / "conform" / "hf_adapter.py"


def main(argv):
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    case = Path(argv[0])
    mine = load_file(str(case / "grads.safetensors"))
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / case.name
        shutil.copytree(case, copy, ignore=shutil.ignore_patterns("grads.safetensors", "result.json", "impl.log"))
        meta = json.loads((copy / "case.json").read_text())
        (copy / "case.json").write_text(json.dumps(dict(meta, ranks=1)))
        subprocess.run([sys.executable, str(ADAPTER), str(copy)], check=True)
        ref = load_file(str(copy / "grads.safetensors"))
    for name in sorted(ref):
        g, r = mine[name].double(), ref[name].double()
        k = float((g * r).sum() / (r * r).sum())
        rest = float((g - k * r).norm() / g.norm().clamp(min=1e-300))
        print(f"{name:60s} x{k:10.4f}  residual {rest:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
