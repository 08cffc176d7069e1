#!/usr/bin/env python3
"""A training step (BP + AdamW) of StreamBP against a peer on the same weights and batch: time ratio and whole-process
peak RSS. The peer (--peer) is what users run today, HF Transformers with gradient checkpointing and
torch.optim.AdamW (hf, in fp32 and bf16), or the paper's code, the official StreamBP's StreamModel with
torch.optim.AdamW (official, fp32; its venv and pinned checkout as the survey makes them, STREAMBP_OFFICIAL_SRC).

Once: a random-weight HF checkpoint and a random SFT batch written by our binary (`streambp run --model-only
--save-model --save-batch`: no step runs).
Then per round the configurations alternate (a shared machine's speed drifts over minutes; alternating spreads the
drift over all of them alike; odd rounds run them in reverse order), each one a fresh process:

    streambp train --load M --data D --method streambp --dtype fp32|bf16 --optimizer adamw:... --steps N --metrics CSV
    python hf_train_step.py --model M --batch D/batch.safetensors --dtype fp32|bf16 --steps N ...        (--peer hf)
    VENV/python official_train_step.py --model M --batch D/batch.safetensors --steps N ...             (--peer official)

Each process's whole-process peak RSS is its rusage ru_maxrss (os.wait4). The step time is BP + optimizer seconds of
steps 2..N (the first step is warm-up; their median), from our metrics CSV and from the peer script's JSON; the
summary takes the median over the rounds. Once per configuration a baseline process loads the model and batch and runs
no step (ours: `streambp run --model-only`; the peer's script with --load-only), so that the peaks can be read both
with and without what the process holds before any step (interpreter and libraries for the peer, the binary for ours).

The summary prints and writes OUT/summary.json (with provenance: commit, date, CPU model and flags, torch and
transformers versions, threads); every process's command, log and outputs stay under OUT/.

    python experiments/hf_side_by_side/paired_runs.py build/streambp --preset qwen3-small --seq 4096 --rounds 3 --out DIR

Run it with the harness venv's python (torch + transformers); --python chooses the peer's interpreter (default: this
one for hf, the survey's streambp-official venv for official, made on first use).
"""
import argparse
import csv
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SURVEY = os.path.join(os.path.dirname(HERE), "survey")
DTYPES = ("fp32", "bf16")
# Each peer: its step script, the dtypes it runs by default, its label, and the goals of issue #63 against it
# (time peer / StreamBP >=, peak RSS StreamBP / peer <=). The goals only label the result: what is measured is
# written either way (an earlier issue asked for 1.3x and 0.35x against HF).
PEERS = {
    "hf": {"script": os.path.join(HERE, "hf_train_step.py"), "dtypes": "fp32,bf16", "label": "HF-ckpt",
           "rss_label": "HF", "goal_time": 1.5, "goal_rss": 0.3},
    "official": {"script": os.path.join(HERE, "official_train_step.py"), "dtypes": "fp32", "label": "official",
                 "rss_label": "official", "goal_time": 2.0, "goal_rss": 0.5, "survey_entry": "streambp-official"},
}


def fail(message):
    """A bad flag or input: the message and exit 2, before anything is written."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def peer_python(peer, python):
    """The peer's interpreter: --python, else this one (hf) or the survey's venv of the pinned official code, made on
    first use by the survey's own functions (experiments/survey/survey.py), from STREAMBP_OFFICIAL_SRC."""
    if python or peer == "hf":
        return python or sys.executable
    sys.path.insert(0, SURVEY)
    import survey
    with open(os.path.join(SURVEY, "implementations.json")) as f:
        entry = next(e for e in json.load(f) if e["name"] == PEERS[peer]["survey_entry"])
    try:
        survey.source_dir(entry)  # the checkout at the pinned commit, or why not
        return survey.venv_python(entry)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        fail(f"--peer {peer}: {e}")


def run_measured(cmd, log_path, ok_codes=(0,)):
    """Run cmd as a fresh process; returns (exit code, peak RSS bytes of that process, wall seconds)."""
    start = datetime.datetime.now()
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = (datetime.datetime.now() - start).total_seconds()
    if proc.returncode not in ok_codes:
        sys.exit(f"error: exit {proc.returncode}: {shlex.join(cmd)} (log: {log_path})")
    return proc.returncode, usage.ru_maxrss * 1024, wall  # Linux: KiB


def lscpu():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return {k: fields[k].strip() for k in ("Model name", "Flags", "CPU(s)", "Thread(s) per core") if k in fields}


def git(*args):
    try:
        return subprocess.run(["git", "-C", HERE, *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def peer_versions(python):
    """The peer interpreter's torch, transformers and safetensors, or a clear error (exit 2) if it lacks them."""
    proc = subprocess.run([python, "-c", "import json, torch, transformers, safetensors; print(json.dumps({"
                           "'torch': torch.__version__, 'transformers': transformers.__version__, "
                           "'safetensors': safetensors.__version__, 'torch_default_threads': torch.get_num_threads()}))"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        fail(f"the peer's python {python} cannot import torch, transformers and safetensors ({last}): run this "
             "script with the harness venv's python (~/.cache/streambp/venv-torch-<version>/bin/python, which make "
             "test makes) or pass --python")
    return json.loads(proc.stdout)


def provenance(a, python, versions):
    cpu = lscpu()
    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu_model": cpu.get("Model name"),
        "cpu_flags": cpu.get("Flags"),
        "cpus": cpu.get("CPU(s)"),
        "load_average_at_start": os.getloadavg(),
        "python": python,
        f"{a.peer}_side": versions,
        "binary": os.path.abspath(a.binary),
        "threads": a.threads,
    }


def metrics_steps(path):
    with open(path) as f:
        return [{"step": int(r["step"]), "loss": float(r["loss"]), "bp_seconds": float(r["bp_seconds"]),
                 "optimizer_seconds": float(r["optimizer_seconds"])} for r in csv.DictReader(f)]


def step_record(steps):
    """One process's numbers: the first step's loss, and the median of steps 2..N (step 1 alone if N = 1)."""
    timed = steps[1:] or steps
    med = lambda key: statistics.median(s[key] for s in timed)
    return {"first_loss": steps[0]["loss"], "losses": [s["loss"] for s in steps],
            "bp_seconds": med("bp_seconds"), "optimizer_seconds": med("optimizer_seconds"),
            "step_seconds": statistics.median(s["bp_seconds"] + s["optimizer_seconds"] for s in timed),
            "first_step_seconds": steps[0]["bp_seconds"] + steps[0]["optimizer_seconds"]}


def peak_floor(baseline_rss, parameters, dtype):
    """The least whole-process peak RSS an exact AdamW step of ours can have: our load-only process (binary, weights,
    batch) plus what the step must add whatever its method, the gradients and AdamW's two states, each the size of the
    trainable weights in the run dtype (the states in the weights' dtype, as torch keeps them). Activations, the
    checkpoints and the head's logits come on top, so a peak-RSS goal below floor / the peer's peak cannot be met by
    any method that keeps those tensors in memory."""
    return baseline_rss + 3 * parameters * {"fp32": 4, "bf16": 2}[dtype]


def loss_check(peer, dtype, ours, theirs, normaliser=None):
    """The first-step losses side by side, on the same weights and batch. HF's loss is ours; the official code's is
    ours times its normaliser's factor (official_train_step.py: targets / unshifted labels, (T - 1) / T at B = 1
    without masking), and has none when its chunk weights are not their target counts. fp32: equal to rounding
    (1e-5 relative; measured ~1e-8 to 1e-7); bf16: loose (2e-2)."""
    factor = 1.0 if peer == "hf" else (normaliser or {}).get("loss_over_target_mean")
    check = {"first_loss_streambp": ours, f"first_loss_{peer}": theirs, "loss_factor": factor,
             "loss_tolerance": 1e-5 if dtype == "fp32" else 2e-2}
    if factor is None:
        check.update({"first_loss_expected": None, "first_loss_relative_difference": None,
                      "loss_check": "not comparable: the official chunk weights are not their target counts"})
        return check
    expected = ours * factor
    check["first_loss_expected"] = expected
    check["first_loss_relative_difference"] = abs(theirs - expected) / abs(expected)
    check["loss_check"] = "ok" if check["first_loss_relative_difference"] <= check["loss_tolerance"] else "MISMATCH"
    return check


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("binary")
    p.add_argument("--peer", choices=sorted(PEERS), default="hf",
                   help="hf: HF Transformers + checkpointing; official: the paper's StreamModel "
                        "(STREAMBP_OFFICIAL_SRC)")
    p.add_argument("--preset", default="qwen3-small")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-fraction", type=float, default=0.0, help="leading labels set to -100 (prompt masking)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="steps per process; the first is warm-up")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of both sides")
    p.add_argument("--dtypes", help="default: fp32,bf16 for hf, fp32 for official")
    p.add_argument("--method", default="streambp", help="our BP method spec")
    p.add_argument("--official-head-chunk", type=int, default=100,
                   help="official: logits_chunk_size (default 100, its README's suggestion)")
    p.add_argument("--official-layer-chunk", type=int, default=0,
                   help="official: checkpoint_chunk_size (0: ceil(T/3), its README's suggestion)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--no-baseline", action="store_true", help="skip the load-only baseline processes")
    p.add_argument("--python",
                   help="interpreter of the peer (default: this one for hf, the survey's venv for official)")
    p.add_argument("--out", required=True)
    p.add_argument("--goal-time", type=float, help="goal for peer / StreamBP step time (>=; default: the peer's, #63)")
    p.add_argument("--goal-rss", type=float, help="goal for StreamBP / peer peak RSS (<=; default: the peer's, #63)")
    a = p.parse_args()
    peer = PEERS[a.peer]
    goal_time = peer["goal_time"] if a.goal_time is None else a.goal_time
    goal_rss = peer["goal_rss"] if a.goal_rss is None else a.goal_rss
    dtypes = (a.dtypes or peer["dtypes"]).split(",")
    if any(d not in DTYPES for d in dtypes):
        fail(f"--dtypes must be from {DTYPES}")
    if a.steps < 1 or a.rounds < 1:
        fail("--steps and --rounds must be >= 1")
    if a.official_head_chunk < 1 or a.official_layer_chunk < 0:
        fail("--official-head-chunk must be >= 1 and --official-layer-chunk >= 0")
    if os.path.exists(a.out):
        fail(f"--out {a.out} exists; results are never overwritten")
    python = peer_python(a.peer, a.python)  # before --out: a peer that cannot run leaves nothing behind
    versions = peer_versions(python)
    os.makedirs(a.out)
    if os.getloadavg()[0] > 0.5:
        print(f"warning: load average {os.getloadavg()[0]:.2f}: the machine is not idle, the times will not mean much",
              file=sys.stderr)
    binary = os.path.abspath(a.binary)
    settings = {"peer": a.peer, "preset": a.preset, "seq": a.seq, "batch": a.batch,
                "prompt_fraction": a.prompt_fraction, "seed": a.seed, "rounds": a.rounds, "steps_per_process": a.steps,
                "threads": a.threads, "method": a.method, "lr": a.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                "weight_decay": a.weight_decay}
    if a.peer == "hf":
        settings.update({"hf_attn_implementation": "sdpa", "hf_gradient_checkpointing": {"use_reentrant": False}})
    else:
        settings.update({"official_logits_chunk_size": a.official_head_chunk,
                         "official_checkpoint_chunk_size": a.official_layer_chunk or -(-a.seq // 3),
                         "official_stream_checkpoint": True, "official_attn_implementation": "sdpa"})
    summary = {"command": shlex.join(sys.argv), "provenance": provenance(a, python, versions), "settings": settings}

    # The shared inputs, written once by our binary without a step (--model-only).
    model_dir, data_dir = os.path.join(a.out, "model"), os.path.join(a.out, "data")
    os.makedirs(data_dir)
    batch_file = os.path.join(data_dir, "batch.safetensors")
    print(f"[setup] {a.preset} random weights and SFT batch B={a.batch} T={a.seq}", file=sys.stderr, flush=True)
    run_measured([binary, "run", "--preset", a.preset, "--seq", str(a.seq), "--batch", str(a.batch),
                  "--prompt-fraction", str(a.prompt_fraction), "--seed", str(a.seed), "--method", "standard",
                  "--save-model", model_dir, "--save-batch", batch_file, "--model-only"],
                 os.path.join(a.out, "setup.log"))
    if not (os.path.exists(os.path.join(model_dir, "config.json")) and os.path.exists(batch_file)):
        sys.exit(f"error: the setup wrote no model or batch (log: {os.path.join(a.out, 'setup.log')})")

    optimizer = f"adamw:lr={a.lr},beta1=0.9,beta2=0.999,eps=1e-8,weight_decay={a.weight_decay}"
    peer_common = [python, peer["script"], "--model", model_dir, "--batch", batch_file, "--threads", str(a.threads),
                   "--lr", str(a.lr), "--weight-decay", str(a.weight_decay), "--eps", "1e-8"]
    if a.peer == "official":
        peer_common += ["--head-chunk", str(a.official_head_chunk), "--layer-chunk", str(a.official_layer_chunk)]
    sides = ("streambp", a.peer)

    def command(side, dtype, stem):
        if side == "streambp":
            return [binary, "train", "--load", model_dir, "--data", data_dir, "--method", a.method, "--dtype", dtype,
                    "--optimizer", optimizer, "--steps", str(a.steps), "--threads", str(a.threads),
                    "--metrics", stem + ".csv"]
        return [*peer_common, "--dtype", dtype, "--steps", str(a.steps), "--out", stem + ".json"]

    def baseline_command(side, dtype, stem):
        if side == "streambp":
            return [binary, "run", "--load", model_dir, "--batch-file", batch_file, "--method", a.method, "--dtype",
                    dtype, "--threads", str(a.threads), "--model-only", "--json", stem + ".json"]
        return [*peer_common, "--dtype", dtype, "--load-only", "--out", stem + ".json"]

    configs = [(side, dtype) for dtype in dtypes for side in sides]
    baselines = {}
    if not a.no_baseline:
        for side, dtype in configs:
            name = f"{side}-{dtype}"
            print(f"[baseline] {name}", file=sys.stderr, flush=True)
            stem = os.path.join(a.out, f"baseline-{name}")
            _, rss, wall = run_measured(baseline_command(side, dtype, stem), stem + ".log")
            baselines[name] = {"peak_rss_bytes": rss, "wall_seconds": wall}

    runs = {f"{side}-{dtype}": [] for side, dtype in configs}
    peer_records = {}  # the peer's JSON of round 0 per dtype: its settings (the official code's loss normaliser)
    for r in range(a.rounds):
        for side, dtype in (configs if r % 2 == 0 else configs[::-1]):
            name = f"{side}-{dtype}"
            print(f"[round {r + 1}/{a.rounds}] {name}", file=sys.stderr, flush=True)
            stem = os.path.join(a.out, f"{name}-{r}")
            _, rss, wall = run_measured(command(side, dtype, stem), stem + ".log")
            if side == "streambp":
                steps = metrics_steps(stem + ".csv")
            else:
                with open(stem + ".json") as f:
                    record = json.load(f)
                steps = record["steps"]
                peer_records.setdefault(dtype, record)
            rec = step_record(steps)
            rec.update({"round": r, "peak_rss_bytes": rss, "wall_seconds": wall})
            runs[name].append(rec)

    with open(os.path.join(a.out, f"streambp-{dtypes[0]}-0.json")) as f:  # the metrics sidecar: the binary's own
        summary["provenance"]["streambp"] = json.load(f)["provenance"]     # provenance (its build's commit, machine)
    if a.peer == "official":  # the pinned code that ran, as its step script found it installed
        summary["provenance"]["official"] = peer_records[dtypes[0]]["official"]

    summary["configs"] = {}
    for name, recs in runs.items():
        med = lambda key: statistics.median(x[key] for x in recs)
        summary["configs"][name] = {
            "step_seconds": med("step_seconds"), "bp_seconds": med("bp_seconds"),
            "optimizer_seconds": med("optimizer_seconds"), "peak_rss_bytes": med("peak_rss_bytes"),
            "step_seconds_all": [x["step_seconds"] for x in recs], "peak_rss_bytes_all": [x["peak_rss_bytes"] for x in recs],
            "first_loss": recs[0]["first_loss"], "losses": recs[0]["losses"],
            "baseline_peak_rss_bytes": baselines.get(name, {}).get("peak_rss_bytes"), "runs": recs}
    summary["comparison"] = {}
    for dtype in dtypes:
        s, h = summary["configs"][f"streambp-{dtype}"], summary["configs"][f"{a.peer}-{dtype}"]
        cmp = {f"time_ratio_{a.peer}_over_streambp": h["step_seconds"] / s["step_seconds"],
               f"peak_rss_ratio_streambp_over_{a.peer}": s["peak_rss_bytes"] / h["peak_rss_bytes"]}
        cmp.update(loss_check(a.peer, dtype, s["first_loss"], h["first_loss"],
                              peer_records[dtype].get("loss_normaliser")))
        if s["baseline_peak_rss_bytes"] and h["baseline_peak_rss_bytes"]:
            ds = s["peak_rss_bytes"] - s["baseline_peak_rss_bytes"]
            dh = h["peak_rss_bytes"] - h["baseline_peak_rss_bytes"]
            cmp[f"peak_rss_above_baseline_ratio_streambp_over_{a.peer}"] = ds / dh if dh > 0 else None
            parameters = peer_records[dtype].get("parameters")
            if parameters:
                floor = peak_floor(s["baseline_peak_rss_bytes"], parameters, dtype)
                cmp["peak_rss_floor_bytes"] = floor
                cmp[f"peak_rss_floor_ratio_over_{a.peer}"] = floor / h["peak_rss_bytes"]
                cmp["rss_goal_reachable"] = floor / h["peak_rss_bytes"] <= goal_rss
        cmp["goal_time_ratio"], cmp["goal_rss_ratio"] = goal_time, goal_rss
        cmp["time_goal_met"] = cmp[f"time_ratio_{a.peer}_over_streambp"] >= goal_time
        cmp["rss_goal_met"] = cmp[f"peak_rss_ratio_streambp_over_{a.peer}"] <= goal_rss
        summary["comparison"][dtype] = cmp
    summary["provenance"]["load_average_at_end"] = os.getloadavg()
    path = os.path.join(a.out, "summary.json")
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(path + ".tmp", path)

    prov = summary["provenance"]
    side = prov[f"{a.peer}_side"]
    mib = lambda b: f"{b / 2**20:8.0f}" if b else "       -"
    label = peer["label"]
    print(f"machine: {prov['cpu_model']}, threads {a.threads}; peer {a.peer}: torch {side['torch']}, transformers "
          f"{side['transformers']}"
          + (f", Ledzy/StreamBP {(prov['official']['commit'] or '?')[:7]}" if a.peer == "official" else "")
          + f"; commit {prov['commit']}{' (dirty)' if prov['dirty'] else ''}")
    print(f"{a.preset}, B={a.batch} T={a.seq}, {a.rounds} rounds x {a.steps} steps (median of steps 2..N, then of rounds)")
    print(f"{'config':<15} {'step s':>8} {'BP s':>8} {'opt s':>7} {'peak MiB':>8} {'base MiB':>8}  first loss")
    for name, c in summary["configs"].items():
        print(f"{name:<15} {c['step_seconds']:8.3f} {c['bp_seconds']:8.3f} {c['optimizer_seconds']:7.3f} "
              f"{mib(c['peak_rss_bytes'])} {mib(c['baseline_peak_rss_bytes'])}  {c['first_loss']:.8g}")
    for dtype, cmp in summary["comparison"].items():
        extra = cmp.get(f"peak_rss_above_baseline_ratio_streambp_over_{a.peer}")
        diff = cmp["first_loss_relative_difference"]
        print(f"{dtype}: time {label}/StreamBP {cmp[f'time_ratio_{a.peer}_over_streambp']:.3f} (goal >= "
              f"{cmp['goal_time_ratio']:g}: {'met' if cmp['time_goal_met'] else 'not met'}), peak RSS "
              f"StreamBP/{peer['rss_label']} {cmp[f'peak_rss_ratio_streambp_over_{a.peer}']:.3f} "
              f"(goal <= {cmp['goal_rss_ratio']:g}: "
              f"{'met' if cmp['rss_goal_met'] else 'not met'})"
              + (f", above baseline {extra:.3f}" if extra is not None else "")
              + (f", floor {cmp[f'peak_rss_floor_ratio_over_{a.peer}']:.3f} (the baseline + gradients + AdamW states"
                 + ("" if cmp["rss_goal_reachable"] else ": the goal is below it") + ")"
                 if f"peak_rss_floor_ratio_over_{a.peer}" in cmp else "")
              + (f"; first-step loss relative difference {diff:.1e}" if diff is not None else "; first-step loss")
              + (f" against ours x {cmp['loss_factor']:.8g}" if a.peer == "official" and diff is not None else "")
              + f" ({cmp['loss_check']})")


if __name__ == "__main__":
    main()
