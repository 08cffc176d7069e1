#!/usr/bin/env python3
"""The paper's code on our batch: N full fine-tuning steps of the official StreamBP (github.com/Ledzy/StreamBP at the
commit experiments/survey/implementations.json pins, entry "streambp-official") with torch.optim.AdamW, on an HF
checkpoint folder and a batch file of ours (issue #63: ahead of the paper's code by 2x at <= 0.5x its peak).

Run it with that entry's venv (survey.py's venv_python: transformers 4.51.3, peft 0.15.1, trl 0.17.0, the pinned
checkout installed -e over the harness venv's torch); paired_runs.py --peer official makes and finds it.

The model is built exactly as the survey's adapter builds it (verify/conform/survey/streambp_official.py build(): the
README's usage, its code is not copied here):
    StreamModel(hf, gradient_accumulation_steps=1, logits_chunk_size=HEAD, stream_checkpoint=True,
                checkpoint_chunk_size=LAYER); model.gradient_checkpointing_enable(); model.train()
with HF's attention "sdpa" and use_cache off. The defaults are the README's suggestions: HEAD = 100, LAYER = ceil(T/3).
Each step: model(input_ids, attention_mask, labels) (StreamModel.forward runs the backward itself and returns a
detached loss), opt.step(), opt.zero_grad(set_to_none=True). Timed per step: "bp" (that call) and "optimizer".

Its loss is not ours (nor HF's) on every batch: it divides by the count of labels that are not -100, unshifted, and
weights each head chunk by its labels minus B. The JSON's "loss_normaliser" says what that makes of this batch: when
every chunk's weight is its count of targets (B = 1 without masking or padding: yes), the loss is the mean over the
targets times targets / divisor, (T - 1) / T, and so is every gradient; else the factor is not one number (null).

The JSON (stdout, and --out FILE) has the same fields as hf_train_step.py's where they mean the same (per-step loss
and seconds, the peak RSS after loading and at the end, versions, threads) and the official code's settings and commit.
The process ends with os._exit(0) once the JSON is written (the interpreter's teardown would raise the peak).

    python official_train_step.py --model M --batch B.safetensors --steps 2 --threads 2 --out official.json
"""
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from hf_train_step import DTYPES, base_record, finish, run_steps, step_arguments

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "verify" / "conform" / "survey"))
import streambp_official  # noqa: E402  (build(): the documented StreamModel usage, shared with the survey)
from streambp_conform.protocol import Case, Objective  # noqa: E402  (streambp_official put verify/conform on the path)


def loss_normaliser(labels, head_chunk):
    """What the official SFT loss is on this batch, next to the mean over the targets (labels[:, 1:] != -100).
    labels: [B, T]. Its head chunk i covers label positions [i*H, min((i+1)*H + 1, T)) (one overlap, HF's shift inside
    the chunk), weighted by its labels that are not -100 minus B (skipped when <= 0); the sum is divided by the labels
    that are not -100 over the whole batch, unshifted."""
    B, T = labels.shape
    valid = labels != -100
    targets, divisor = int(valid[:, 1:].sum()), int(valid.sum())
    mismatched = []
    for start in range(0, T, head_chunk):
        end = min(start + head_chunk + 1, T)
        weight = max(int(valid[:, start:end].sum()) - B, 0)
        chunk_targets = int(valid[:, start + 1:end].sum())
        if weight != chunk_targets:
            mismatched.append({"start": start, "weight": weight, "targets": chunk_targets})
    return {"divisor": divisor, "targets": targets, "chunk_weights_are_target_counts": not mismatched,
            "mismatched_chunks": mismatched[:8],
            "loss_over_target_mean": targets / divisor if not mismatched and divisor else None}


def source_commit(package_file):
    """The pinned checkout's commit: its COMMIT file (a `git archive` export) or its git HEAD."""
    for parent in Path(package_file).resolve().parents:
        if (parent / "COMMIT").exists():
            return (parent / "COMMIT").read_text().strip(), str(parent)
        if (parent / ".git").exists():
            head = subprocess.run(["git", "-C", str(parent), "rev-parse", "HEAD"], capture_output=True, text=True)
            return head.stdout.strip() or None, str(parent)
    return None, None


def main():
    p = step_arguments(__doc__)
    p.add_argument("--head-chunk", type=int, default=100, help="logits_chunk_size (the README's suggestion: 100)")
    p.add_argument("--layer-chunk", type=int, default=0,
                   help="checkpoint_chunk_size (0: ceil(T/3), the README's suggestion)")
    a = p.parse_args()
    if a.steps < 1 or a.head_chunk < 1 or a.layer_chunk < 0:
        print("error: --steps and --head-chunk must be >= 1, --layer-chunk >= 0", file=sys.stderr)
        sys.exit(2)
    model_dir = Path(a.model).resolve()
    if not (model_dir / "config.json").exists():
        print(f"error: --model {a.model}: no config.json (an HF checkpoint folder, as `streambp run --save-model` "
              "writes it)", file=sys.stderr)
        sys.exit(2)
    if not Path(a.batch).is_file():
        print(f"error: --batch {a.batch}: no such file", file=sys.stderr)
        sys.exit(2)
    if a.threads > 0:
        torch.set_num_threads(a.threads)

    t0 = time.perf_counter()
    batch = load_file(a.batch)
    missing = {"input_ids", "attention_mask", "labels"} - set(batch)
    if missing:
        print(f"error: {a.batch}: missing tensors {sorted(missing)} (an SFT batch of `streambp run --save-batch`)",
              file=sys.stderr)
        sys.exit(2)
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    T = ids.shape[1]
    layer_chunk = a.layer_chunk or math.ceil(T / 3)
    dtype = DTYPES[a.dtype]
    # build() reads CASE_DIR/model, as a conformance case holds it: a scratch folder whose "model" is --model.
    case_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"official-step-{os.getpid()}"
    case_dir.mkdir()
    try:
        (case_dir / "model").symlink_to(model_dir)
        case = Case(case_dir, "side-by-side", dtype, Objective("sft"), False, a.head_chunk, batch, layer_chunk)
        model, trainable = streambp_official.build(case, {"chunks": {"head": a.head_chunk, "layer": layer_chunk}})
    finally:
        (case_dir / "model").unlink(missing_ok=True)
        case_dir.rmdir()
    params = list(trainable.values())  # tied embeddings: one tensor
    wrong = sorted({str(q.dtype) for q in params} - {str(dtype)})
    if wrong:
        print(f"error: parameters in {wrong}, expected {dtype}", file=sys.stderr)
        sys.exit(2)
    load_seconds = time.perf_counter() - t0

    import peft
    import streambp
    commit, checkout = source_commit(streambp.__file__)
    record = base_record(a, params, batch, load_seconds)
    record["versions"]["peft"] = peft.__version__
    record.update({
        "model_class": type(model).__name__ + "(" + type(model.model).__name__ + ")",
        "attn_implementation": model.model.config._attn_implementation,
        "official": {"repo": "Ledzy/StreamBP", "commit": commit, "checkout": checkout,
                     "logits_chunk_size": a.head_chunk, "checkpoint_chunk_size": layer_chunk,
                     "stream_checkpoint": True, "gradient_accumulation_steps": 1,
                     "gradient_checkpointing": any(getattr(m, "gradient_checkpointing", False)
                                                   for m in model.modules())},
        "loss_normaliser": loss_normaliser(labels, a.head_chunk),
    })
    if not a.load_only:
        def bp():
            out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False, return_dict=True)
            if out.loss.requires_grad:  # as the survey's adapter: the backward already ran inside forward
                out.loss.backward()
            return out.loss.item()

        run_steps(a, params, bp, record)
    finish(record, a.out)


if __name__ == "__main__":
    main()
