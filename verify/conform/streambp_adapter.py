"""The harness's own methods as a conformance implementation (docs/conformance.md): reads a case directory of the
streambp-conform/1 protocol, runs `streambp run` on its model, adapter and batch with the case's objective, and
writes grads.safetensors and result.json. It is what a wrapper around any command-line trainer looks like, and it
lets the protocol be tested without Python packages: only the standard library.

Usage: python3 streambp_adapter.py [--streambp BIN] [--method SPEC] CASE_DIR
  --method: standard, checkpoint, mst, or streambp (default), whose chunks default to the case's suggestions.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

DTYPES = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16"}


def objective_spec(o):
    """The harness's objective spec from case.json's TRL-named objective."""
    if o["name"] == "sft":
        return "sft"
    if o["name"] == "grpo":
        keys = {"beta": o["beta"], "epsilon_low": o["epsilon"], "epsilon_high": o["epsilon_high"],
                "loss_type": o["loss_type"], "importance": o["importance_sampling_level"],
                "temperature": o["temperature"], "max_completion_length": o["max_completion_length"]}
    elif o["name"] == "dpo":
        if o.get("loss_type", "sigmoid") != "sigmoid":
            sys.exit(f"DPO loss_type {o['loss_type']} is not implemented")
        keys = {"beta": o["beta"], "label_smoothing": o["label_smoothing"]}
    else:
        sys.exit(f"unknown objective {o['name']}")
    return o["name"] + ":" + ",".join(f"{k}={v!r}" if isinstance(v, float) else f"{k}={v}" for k, v in keys.items())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--streambp", default=os.environ.get("STREAMBP_BIN", "streambp"))
    parser.add_argument("--method", default="streambp")
    parser.add_argument("case_dir", type=Path)
    args = parser.parse_args()
    case_dir = args.case_dir
    case = json.loads((case_dir / "case.json").read_text())
    if case.get("ranks", 1) != 1:  # `streambp run` is one process (the harness's ranks: train --nproc N [--sp N])
        print(f"{case_dir.name}: {case['ranks']} ranks: streambp run is one process", file=sys.stderr)
        sys.exit(3)  # not expressible (protocol.py)
    if "micro_batches" in case:  # exit status 3: not expressible (`streambp run` is one batch, one step)
        print(f"{len(case['micro_batches'])} micro-batches: streambp run takes one batch per step", file=sys.stderr)
        sys.exit(3)
    method = args.method
    if method == "streambp":
        method = f"streambp:layer_chunk={case['chunks']['layer']},head_chunk={case['chunks']['head']}"
    tmp_grads, tmp_json = case_dir / ".grads.tmp.safetensors", case_dir / ".run.tmp.json"
    command = [args.streambp, "run", "--load", str(case_dir / "model"), "--dtype", DTYPES[case["dtype"]],
               "--method", method, "--objective", objective_spec(case["objective"]),
               "--batch-file", str(case_dir / "batch.safetensors"), "--save-grads", str(tmp_grads),
               "--json", str(tmp_json), "--threads", "1", "--force"]
    if case["lora"]:
        command += ["--adapter", str(case_dir / "adapter")]
    subprocess.run(command, check=True)
    record = json.loads(tmp_json.read_text())
    # Atomic outputs: a reader sees whole files or none.
    os.replace(tmp_grads, case_dir / "grads.safetensors")
    result = case_dir / ".result.tmp.json"
    result.write_text(json.dumps({"loss": record["loss"], "seconds": record.get("bp_seconds")}) + "\n")
    os.replace(result, case_dir / "result.json")
    tmp_json.unlink()


if __name__ == "__main__":
    main()
