"""Shared by the packing-bug reproductions beside this file. Each script runs itself once per pinned release (--inner),
in a venv made exactly as the survey makes its entries' (experiments/survey/survey.py venv_python: the pins installed
over the harness venv, whose torch they see), reads the one JSON line the inner run prints last, and says the verdict.
The outer run needs only the standard library; run it with the harness venv's python, which the venvs layer over."""
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import survey  # noqa: E402


def run_pinned(entry, script, env=None):
    """The inner run of `script` in the venv of `entry` (a survey entry: name, venv, requirements): its JSON dict."""
    python = survey.venv_python(entry)
    done = subprocess.run([python, str(script), "--inner"], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})))
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{entry['name']}: the inner run failed (exit {done.returncode}):\n{tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def normwise(grads, reference):
    """||g - g_ref|| / ||g_ref|| over every tensor together, and the tensor whose own relative error is largest. The
    inputs are {name: tensor}; torch is imported by the caller's (inner) process only."""
    import torch

    diff = sum(float((grads[n] - reference[n]).double().pow(2).sum()) for n in reference)
    norm = sum(float(reference[n].double().pow(2).sum()) for n in reference)
    worst = max(reference, key=lambda n: float((grads[n] - reference[n]).double().norm())
                / max(float(reference[n].double().norm()), torch.finfo(torch.float64).tiny))
    return (diff / norm) ** 0.5, worst


def emit(result):
    """The inner run's last stdout line: what the outer run reads."""
    print(json.dumps(result), flush=True)
