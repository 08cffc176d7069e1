"""The harness's own methods as a conformance implementation (docs/conformance.md): reads a case directory of the
streambp-conform/1 protocol, runs the harness on its model, adapter and batch with the case's objective, and writes
grads.safetensors and result.json: `streambp run` for a one-process step, `streambp train --steps 1 --save-grads`
for a step of several micro-batches (--micro-batches, the trainer's accumulation) or of several ranks (--nproc, and
--sp for a sequence split: the trainer's reduction). It is what a wrapper around any command-line trainer looks like,
and it lets the protocol be tested without Python packages: only the standard library.

Usage: python3 streambp_adapter.py [--streambp BIN] [--method SPEC] CASE_DIR
  --method: standard, checkpoint, mst, or streambp (default), whose chunks default to the case's suggestions.
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
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
    if case.get("kind", "batch") != "batch":  # a whole RL step (conform's rl set): no batch to hand `run` or `train`
        print(f"{case_dir.name}: kind {case['kind']}: this adapter runs a trainer's step on a batch (the harness's RL "
              "step is its oracle, `streambp rl-step`)", file=sys.stderr)
        sys.exit(3)  # not expressible (protocol.py)
    ranks, parallel = case.get("ranks", 1), case.get("parallel", "data")
    micro = case.get("micro_batches") or []
    method = args.method
    if method == "streambp":
        method = f"streambp:layer_chunk={case['chunks']['layer']},head_chunk={case['chunks']['head']}"
    if ranks > 1 and parallel == "data" and batch_rows(case_dir) % ranks:
        print(f"{case_dir.name}: {batch_rows(case_dir)} rows do not split over {ranks} data-parallel ranks",
              file=sys.stderr)
        sys.exit(3)  # not expressible (protocol.py): train gives each rank an equal share of the rows
    tmp_grads, tmp_json = case_dir / ".grads.tmp.safetensors", case_dir / ".run.tmp.json"
    common = ["--load", str(case_dir / "model"), "--dtype", DTYPES[case["dtype"]], "--method", method,
              "--objective", objective_spec(case["objective"]), "--save-grads", str(tmp_grads),
              "--json", str(tmp_json), "--threads", "1", "--force"]
    if case["lora"]:
        common += ["--adapter", str(case_dir / "adapter")]
    if ranks == 1 and not micro:
        subprocess.run([args.streambp, "run", "--batch-file", str(case_dir / "batch.safetensors")] + common, check=True)
    else:  # the trainer's step: its accumulation over the micro-batches, its reduction over the ranks
        if parallel == "sequence" and method.startswith("mst"):
            print(f"{case_dir.name}: MsT does not run on a sequence-parallel rank's shard", file=sys.stderr)
            sys.exit(3)
        with tempfile.TemporaryDirectory() as data:  # train reads a folder of batch files
            os.symlink(case_dir.resolve() / "batch.safetensors", Path(data) / "batch.safetensors")
            command = [args.streambp, "train", "--data", data, "--steps", "1"] + common
            if micro:
                command += ["--micro-batches", ";".join(",".join(str(r) for r in m) for m in micro)]
            if ranks > 1:
                command += ["--nproc", str(ranks)] + (["--sp", str(ranks)] if parallel == "sequence" else [])
            subprocess.run(command, check=True)
    record = json.loads(tmp_json.read_text())
    # Atomic outputs: a reader sees whole files or none.
    os.replace(tmp_grads, case_dir / "grads.safetensors")
    result = case_dir / ".result.tmp.json"
    loss = record["loss"] if "loss" in record else record["final_loss"]
    out = {"loss": loss, "seconds": record.get("bp_seconds")}
    if micro:
        out["micro_batches"] = len(micro)
    result.write_text(json.dumps(out) + "\n")
    os.replace(result, case_dir / "result.json")
    tmp_json.unlink()


def batch_rows(case_dir):
    """input_ids' rows, from batch.safetensors' header (the format: an 8-byte length, then JSON)."""
    raw = (case_dir / "batch.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n])["input_ids"]["shape"][0]


if __name__ == "__main__":
    main()
