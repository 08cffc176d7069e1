"""`streambp train` is HF training: 8 optimizer steps of our binary on a --data folder equal, in fp64, a plain PyTorch
loop over HF Transformers' Qwen3 (and PEFT's LoRA) on the same initial checkpoint and the same batch files in the same
order (cycled): torch.optim.AdamW(trainable parameters, lr, betas, eps, weight_decay),
transformers.get_cosine_schedule_with_warmup(opt, 2, 8), torch.nn.utils.clip_grad_norm_(params, 0.5) before each
update, and the SFT loss computed from fp64 logits with HF's shifted labels (-100 ignored), the mean over the global
batch's target tokens (with --grad-accum K: each micro-batch's NLL sum divided by the step's total target count,
HF/TRL's num_items_in_batch).

Checked per step against the metrics CSV: loss (relative 1e-12), grad_norm (clip_grad_norm_'s return value, relative
1e-12), lr (equal) and tokens (equal); after the last step every trained tensor of --save-model / --save-adapter
against the oracle's: normwise max|ours - HF| / max|HF| <= 1e-10, and the same for the update (M8 - M0 against
HF's final - M0), the stricter measure since the update is ~1e-2 of the weights. Clipping must act (full
fine-tuning clips every step at 0.5, LoRA all but one: both branches of clip_grad_norm_ run).

Cases: full fine-tuning through streambp:layer_chunk=5,head_chunk=7 and standard; --grad-accum 2 (each step's two
rows as two micro-batches of different target counts); LoRA rank 4 from an adapter the binary saved (--adapter A0),
against PeftModel.from_pretrained.
Negative controls (each must FAIL the final-weight comparison, or the check could not fail): the oracle with
weight_decay=0 while ours used 0.1, and the --grad-accum 2 run against the per-micro-batch-mean normalisation (each
micro-batch's mean / K, the pre-4.46 HF Trainer bug).

Usage: python tests/oracle/train_oracle.py BUILD/streambp
RMSNorm is patched as in tests/oracle/hf_parity.py (fp64 stays fp64; docs/departures-from-hf.md).
Exit 0 pass, 1 fail (also when transformers/peft are missing).
"""
import csv
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

try:
    import torch
    import transformers
    import peft
    from peft import PeftModel
    from safetensors.torch import load_file
except ImportError as e:  # an oracle that cannot run fails: a CI without its oracles is not green
    print(f"FAIL: missing oracle dependency: {e} (make installs transformers and peft into the venv)")
    sys.exit(1)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from hf_parity import patch_rms_norms  # noqa: E402  (the one RMSNorm patch, shared)

STEPS, WARMUP, LR, WD, CLIP = 8, 2, 1e-2, 0.1, 0.5
BETAS, EPS = (0.9, 0.999), 1e-8
TRAIN_ARGS = ["--dtype", "fp64", "--steps", STEPS, "--optimizer", f"adamw:lr={LR},weight_decay={WD}",
              "--lr-schedule", f"cosine,warmup={WARMUP}", "--clip-grad-norm", CLIP]
STREAMBP = "streambp:layer_chunk=5,head_chunk=7"
WEIGHT_RTOL = 1e-10  # final tensors and their updates, normwise per tensor
STEP_RTOL = 1e-12    # per-step loss and gradient norm
FAILURES = []


def fail(msg):
    FAILURES.append(msg)
    print("FAIL:", msg)


def sbp(binary, command, args, what):
    p = subprocess.run([binary, command, *map(str, args)], capture_output=True, text=True)
    if p.returncode != 0:
        fail(f"{what}: streambp {command} exited {p.returncode}\n{p.stdout}{p.stderr}")
        return False
    return True


# ------------------------------------------------------------------------------------------------ the oracle

def shifted_labels(labels):
    return torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]


def hf_train(m0, batches, adapter=None, weight_decay=WD, grad_accum=1, normalisation="global"):
    """The reference loop. Returns per-step rows (loss, grad_norm, lr, tokens) and {file name: final tensor}."""
    base = transformers.AutoModelForCausalLM.from_pretrained(m0, dtype=torch.float64, attn_implementation="sdpa")
    model = base if adapter is None else PeftModel.from_pretrained(base, adapter, is_trainable=True)
    model.train()
    # PEFT's parameter names carry the adapter name, the adapter file's do not.
    named = [(n.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."), p)
             for n, p in model.named_parameters() if p.requires_grad]
    if any(p.dtype != torch.float64 for _, p in named):
        fail(f"oracle: a trainable tensor is not fp64: {[(n, p.dtype) for n, p in named if p.dtype != torch.float64]}")
    params = [p for _, p in named]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay)
    sched = transformers.get_cosine_schedule_with_warmup(opt, WARMUP, STEPS)
    rows = []
    for s in range(STEPS):
        b = batches[s % len(batches)]
        opt.zero_grad(set_to_none=True)
        lr = opt.param_groups[0]["lr"]
        total = int((shifted_labels(b["labels"]) != -100).sum())
        step_loss = 0.0
        for ids, mask, labels in zip(*(b[k].chunk(grad_accum) for k in ("input_ids", "attention_mask", "labels"))):
            logits = model(input_ids=ids, attention_mask=mask).logits  # fp64
            target = shifted_labels(labels).flatten()
            if grad_accum == 1:  # exactly hf_parity's loss
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target, ignore_index=-100)
            elif normalisation == "global":  # num_items_in_batch: the step's total target count
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target, ignore_index=-100,
                                                         reduction="sum") / total
            else:  # negative control: each micro-batch's own mean, averaged over the K micro-batches
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target, ignore_index=-100) / grad_accum
            loss.backward()
            step_loss += loss.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, CLIP).item()
        opt.step()
        sched.step()
        rows.append({"step": s + 1, "loss": step_loss, "grad_norm": grad_norm, "lr": lr, "tokens": total})
    return rows, {n: p.detach().clone() for n, p in named}


# ------------------------------------------------------------------------------------------------ the comparison

def normwise(ours, ref):
    scale = ref.abs().max().item()
    diff = (ours.to(torch.float64) - ref).abs().max().item()
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def compare(what, metrics_csv, ours_file, initial, ref_rows, ref_final):
    """Problems of ours against the oracle (empty: equal within tolerance), with the worst errors printed."""
    problems = []
    with open(metrics_csv) as f:
        ours_rows = list(csv.DictReader(f))
    if [int(r["step"]) for r in ours_rows] != list(range(1, STEPS + 1)):
        problems.append(f"metrics steps {[r['step'] for r in ours_rows]}, expected 1..{STEPS}")
    worst_loss = worst_norm = 0.0
    for o, h in zip(ours_rows, ref_rows):
        s = h["step"]
        loss_err = abs(float(o["loss"]) - h["loss"]) / abs(h["loss"])
        norm_err = abs(float(o["grad_norm"]) - h["grad_norm"]) / abs(h["grad_norm"])
        worst_loss, worst_norm = max(worst_loss, loss_err), max(worst_norm, norm_err)
        if not loss_err <= STEP_RTOL:
            problems.append(f"step {s}: loss {o['loss']} vs HF {h['loss']!r} (relative {loss_err:.2e})")
        if not norm_err <= STEP_RTOL:
            problems.append(f"step {s}: grad_norm {o['grad_norm']} vs HF {h['grad_norm']!r} (relative {norm_err:.2e})")
        if float(o["lr"]) != h["lr"]:
            problems.append(f"step {s}: lr {o['lr']} vs HF's schedule {h['lr']!r}")
        if int(o["tokens"]) != h["tokens"]:
            problems.append(f"step {s}: tokens {o['tokens']} vs {h['tokens']} target tokens")
    clipped = sum(h["grad_norm"] > CLIP for h in ref_rows)
    ours = load_file(str(ours_file))
    if set(ours) != set(ref_final):
        problems.append(f"tensor names differ: {sorted(set(ours) ^ set(ref_final))[:6]}")
    worst_w, worst_u, worst_w_name, worst_u_name, moved = 0.0, 0.0, "", "", 0.0
    for n, ref in ref_final.items():
        if n not in ours:
            continue
        w = normwise(ours[n], ref)
        u = normwise(ours[n].to(torch.float64) - initial[n], ref - initial[n])
        moved = max(moved, normwise(ref, initial[n]) if n in initial else 0.0)
        if not w <= worst_w:
            worst_w, worst_w_name = w, n
        if not u <= worst_u:
            worst_u, worst_u_name = u, n
        if not w <= WEIGHT_RTOL:
            problems.append(f"{n}: final tensor normwise relative error {w:.3e}")
        if not u <= WEIGHT_RTOL:
            problems.append(f"{n}: update (final - initial) normwise relative error {u:.3e}")
    print(f"  {what}: worst loss error {worst_loss:.1e}, grad_norm {worst_norm:.1e} ({clipped}/{STEPS} steps clipped); "
          f"final tensors {worst_w:.1e} ({worst_w_name}), updates {worst_u:.1e} ({worst_u_name}) over {len(ref_final)} "
          f"tensors")
    if clipped == 0:
        problems.append(f"the oracle clipped none of the {STEPS} steps: clipping is not tested")
    return problems


def expect_pass(what, problems):
    print(f"{'FAIL' if problems else 'ok'}: {what}")
    for p in problems:
        fail(f"{what}: {p}")


def expect_fail(what, problems):
    """A negative control: the comparison must find the wrong oracle's final weights different."""
    weight_problems = [p for p in problems if "normwise" in p]
    if weight_problems:
        print(f"ok: negative control {what} fails as it must ({len(problems)} problems, e.g. {weight_problems[0]})")
    else:
        fail(f"negative control {what}: the final weights match a wrong oracle: the comparison cannot fail")


# ------------------------------------------------------------------------------------------------ the cases

def main():
    binary = sys.argv[1]
    start = time.time()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    patch_rms_norms()
    torch.manual_seed(0)
    print(f"transformers {transformers.__version__}, peft {peft.__version__}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        m0, data = work / "M0", work / "data"
        # The tiny preset: Qwen3 with qk_norm, tied embeddings (one trained tensor, model.embed_tokens.weight).
        if not sbp(binary, "run", ["--preset", "tiny", "--dtype", "fp64", "--method", "standard", "--seq", 16,
                                   "--seed", 3, "--save-model", m0], "initial model"):
            return 1
        data.mkdir()
        for s in range(1, 5):  # 2 rows each, rows with different padding: different target counts per row
            if not sbp(binary, "run", ["--load", m0, "--dtype", "fp64", "--method", "standard", "--batch", 2, "--seq",
                                       24, "--pad-fraction", 0.3, "--prompt-fraction", 0.2, "--seed", 10 + s,
                                       "--save-batch", data / f"batch-{s:02d}.safetensors"], f"batch {s}"):
                return 1
        batches = [load_file(str(f)) for f in sorted(data.glob("*.safetensors"))]
        row_tokens = [(shifted_labels(b["labels"]) != -100).sum(-1).tolist() for b in batches]
        print(f"data: {len(batches)} batches of shape {list(batches[0]['input_ids'].shape)}, target tokens per row "
              f"{row_tokens}")
        if not any(r[0] != r[1] for r in row_tokens):
            fail("every batch's rows have equal target counts: the --grad-accum normalisation would not be tested")
        initial = load_file(str(m0 / "model.safetensors"))

        def ours(name, method, extra, output_flag="--save-model"):
            d = work / name
            d.mkdir()
            out = d / "out"
            ok = sbp(binary, "train", ["--load", m0, "--method", method, "--data", data, *TRAIN_ARGS, *extra,
                                       "--metrics", d / "m.csv", output_flag, out], name)
            weights = out / ("model.safetensors" if output_flag == "--save-model" else "adapter_model.safetensors")
            return (d / "m.csv", weights) if ok else None

        print("oracle: full fine-tuning")
        ref_rows, ref_final = hf_train(m0, batches)
        runs = {m: ours(f"full-{m.split(':')[0]}", m, []) for m in (STREAMBP, "standard")}
        for m, r in runs.items():
            if r:
                expect_pass(f"full fine-tuning, {m}", compare(m, *r, initial, ref_rows, ref_final))
        if runs[STREAMBP]:
            print("oracle: weight_decay=0 (negative control)")
            expect_fail("weight_decay=0 in the oracle", compare(f"{STREAMBP} vs oracle without weight decay",
                                                                *runs[STREAMBP], initial, *hf_train(m0, batches,
                                                                                                    weight_decay=0.0)))

        print("oracle: --grad-accum 2 (normalised by the step's target count)")
        r = ours("accum-streambp", STREAMBP, ["--grad-accum", 2])
        if r:
            expect_pass(f"--grad-accum 2, {STREAMBP}",
                        compare(f"{STREAMBP} --grad-accum 2", *r, initial, *hf_train(m0, batches, grad_accum=2)))
            print("oracle: --grad-accum 2 with per-micro-batch means (negative control)")
            expect_fail("per-micro-batch mean normalisation",
                        compare(f"{STREAMBP} --grad-accum 2 vs per-micro-batch means", *r, initial,
                                *hf_train(m0, batches, grad_accum=2, normalisation="per-micro-batch")))

        print("oracle: LoRA rank 4 (PEFT)")
        a0 = work / "A0"
        if sbp(binary, "run", ["--load", m0, "--dtype", "fp64", "--method", "standard", "--seq", 8, "--seed", 5,
                               "--lora", "rank=4,alpha=8", "--save-adapter", a0], "initial adapter"):
            a_initial = load_file(str(a0 / "adapter_model.safetensors"))
            ref_rows, ref_final = hf_train(m0, batches, adapter=a0)
            for m in (STREAMBP, "standard"):
                r = ours(f"lora-{m.split(':')[0]}", m, ["--adapter", a0], output_flag="--save-adapter")
                if r:
                    expect_pass(f"LoRA, {m}", compare(f"LoRA {m}", *r, a_initial, ref_rows, ref_final))
    print(f"{'FAILED' if FAILURES else 'passed'}: {len(FAILURES)} failure(s), {time.time() - start:.1f} s")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
