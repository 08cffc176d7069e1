#!/usr/bin/env python3
"""What users run today: N full fine-tuning steps of HF Transformers' Qwen3ForCausalLM with gradient checkpointing and
torch.optim.AdamW, on an HF checkpoint folder and a batch file of ours (issue: StreamBP side by side with HF).

The model is loaded in the requested dtype (fp32, or bf16 = pure bf16 weights, gradients and AdamW states, as the
paper's full training), attention "sdpa" (HF's default), gradient checkpointing of every decoder layer
(use_reentrant=False; transformers 5's activation_checkpointing_enable, the renamed gradient_checkpointing_enable),
use_cache off, train mode. Each step: forward with labels (HF's loss: logits upcast to fp32, labels shifted, mean
cross-entropy over the target tokens, -100 ignored, i.e. our SFT normalisation), backward, opt.step(),
opt.zero_grad(set_to_none=True). Timed per step: "bp" (forward + loss + backward) and "optimizer" (step + zero_grad).

The batch file is what `streambp run --save-batch` writes: safetensors with input_ids, attention_mask and labels
(int64 [B, T], labels unshifted, -100 on the prompt and the right padding), the same batch every step, as
`streambp train --data DIR` with one file in DIR.

The process ends with os._exit(0) once the JSON is written (the interpreter's teardown would add ~125 MB to the
whole-process peak after the work). The JSON (stdout, and --out FILE) has per-step loss and seconds, the whole-process peak RSS (ru_maxrss) after loading
the model and batch (the baseline: no step yet) and at the end, versions and settings.

    python hf_train_step.py --model M --batch B.safetensors --dtype fp32 --steps 2 --threads 2 --out hf.json
"""
import argparse
import json
import os
import platform
import resource
import sys
import time

import torch
import transformers
from safetensors.torch import load_file

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def current_rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def step_arguments(doc):
    """The options every side's step script takes (official_train_step.py too): model, batch, dtype, steps, AdamW,
    threads, --load-only, --out."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF checkpoint folder (config.json + safetensors)")
    p.add_argument("--batch", required=True, help="batch file (safetensors: input_ids, attention_mask, labels)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=0.0, help="default 0 as ours (torch.optim.AdamW's is 0.01)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    p.add_argument("--load-only", action="store_true", help="load the model and batch, report the RSS, run no step")
    p.add_argument("--out", help="also write the JSON here")
    return p


def base_record(a, params, batch, load_seconds):
    """The JSON fields every side's step script writes alike, after loading and before any step."""
    return {
        "model": a.model,
        "batch": a.batch,
        "dtype": a.dtype,
        "parameters": sum(q.numel() for q in params),
        "batch_size": batch["input_ids"].shape[0],
        "seq_len": batch["input_ids"].shape[1],
        "target_tokens": int((batch["labels"][:, 1:] != -100).sum()),
        "optimizer": {"name": "torch.optim.AdamW", "lr": a.lr, "betas": [a.beta1, a.beta2], "eps": a.eps,
                      "weight_decay": a.weight_decay, "foreach": None},
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "load_seconds": load_seconds,
        "baseline_peak_rss_bytes": peak_rss_bytes(),  # model and batch loaded, no step yet
        "baseline_rss_bytes": current_rss_bytes(),
        "steps": [],
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "torch_config": torch.__config__.parallel_info(),
    }


def run_steps(a, params, bp, record):
    """a.steps steps of bp() (forward + loss + backward, returns the loss as a float), opt.step() and
    opt.zero_grad(set_to_none=True) with torch.optim.AdamW, each timed into record["steps"]."""
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps, weight_decay=a.weight_decay)
    for s in range(1, a.steps + 1):
        t0 = time.perf_counter()
        loss = bp()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        record["steps"].append({"step": s, "loss": loss, "bp_seconds": t1 - t0, "optimizer_seconds": t2 - t1,
                                "peak_rss_bytes": peak_rss_bytes()})
        print(f"step {s}/{a.steps}  loss {loss:.6g}  bp {t1 - t0:.3f} s  optimizer {t2 - t1:.3f} s",
              file=sys.stderr, flush=True)
    states = {str(v.dtype) for st in opt.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")}
    record["optimizer_state_dtypes"] = sorted(states)


def finish(record, out):
    """The final peak, the JSON on stdout and in --out (a temp file, then rename), and an exit without teardown."""
    record["peak_rss_bytes"] = peak_rss_bytes()
    text = json.dumps(record, indent=2)
    if out:
        with open(out + ".tmp", "w") as f:
            f.write(text + "\n")
        os.replace(out + ".tmp", out)
    print(text)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: on this stack it raises the process's peak RSS by ~125 MB after the work
    # (measured: fp32 qwen3-small loaded, 757 MB before exit, 883 MB ru_maxrss with a normal exit, 757 MB without).
    os._exit(0)


def main():
    p = step_arguments(__doc__)
    p.add_argument("--attn", default="sdpa", help="attn_implementation (default sdpa, HF's default)")
    p.add_argument("--no-checkpointing", action="store_true", help="plain HF training, no gradient checkpointing")
    a = p.parse_args()
    if a.steps < 1:
        sys.exit("error: --steps must be >= 1")
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()

    t0 = time.perf_counter()
    dtype = DTYPES[a.dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, attn_implementation=a.attn)
    model.config.use_cache = False
    if not a.no_checkpointing:  # transformers 5 renamed it; the old name warns (removed in v6)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = load_file(a.batch)
    missing = {"input_ids", "attention_mask", "labels"} - set(batch)
    if missing:
        sys.exit(f"error: {a.batch}: missing tensors {sorted(missing)} (an SFT batch of `streambp run --save-batch`)")
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    params = list(model.parameters())  # tied embeddings: one tensor
    wrong = sorted({str(q.dtype) for q in params} - {str(dtype)})
    if wrong:
        sys.exit(f"error: parameters in {wrong}, expected {dtype}")
    load_seconds = time.perf_counter() - t0
    record = base_record(a, params, batch, load_seconds)
    record.update({
        "model_class": type(model).__name__,
        "attn_implementation": model.config._attn_implementation,
        "gradient_checkpointing": any(getattr(m, "gradient_checkpointing", False) for m in model.modules()),
        "gradient_checkpointing_kwargs": None if a.no_checkpointing else {"use_reentrant": False},
    })
    if not a.load_only:
        def bp():
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            return loss.item()

        run_steps(a, params, bp, record)
    finish(record, a.out)


if __name__ == "__main__":
    main()
