"""Figures from results/ (read-only): peak memory and BP time ratio vs sequence length, one figure per demo or
`sweep seq` CSV; per-sample time and peak vs batch size (`sweep batch`); time and peak vs StreamBP's chunk sizes
(`sweep partition`); the linear toy's bytes and time vs partitions (`toy`); live bytes by category over two steps
(`profile`, Fig. 1/8); gradient error vs chunk count, one figure
per `streambp verify` CSV that sweeps StreamBP's chunks; training loss curves of the runs side by side, one figure
per folder of `train --metrics` CSVs (results/train-*/<run>/loss.png).

Usage: python plots/plot_results.py [results_dir]   (writes <csv stem>.png next to each CSV that has no figure yet)
"""
import math
import csv
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save(fig, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_demo(csv_path: Path) -> Path:
    rows = list(csv.DictReader(csv_path.open()))
    # A time ratio exists only where the same run measured checkpointing at that T (files written before empty cells
    # were introduced hold 0 there instead: never plotted).
    timed_lengths = {r["seq_len"] for r in rows if r["method"] == "checkpoint" and r["status"] != "oom"}
    by_method = defaultdict(list)
    for r in rows:
        by_method[r["method"]].append(r)
    fig, (mem, time) = plt.subplots(1, 2, figsize=(11, 4))
    for method, rs in by_method.items():
        rs.sort(key=lambda r: int(r["seq_len"]))
        T = [int(r["seq_len"]) for r in rs]
        # oom rows (over the sweep's budget) have no measured peak: only the model is drawn there.
        measured = [(t, int(r["peak_bytes"]) / 2**30) for t, r in zip(T, rs) if r["peak_bytes"]]
        oom = [t for t, r in zip(T, rs) if r["status"] == "oom"]
        label = f"{method} (measured)" + (f"; oom at T = {', '.join(map(str, oom))}" if oom else "")
        line, = mem.plot([t for t, _ in measured], [p for _, p in measured], "o-", label=label)
        mem.plot(T, [int(r["model_peak_bytes"]) / 2**30 for r in rs], "--", color=line.get_color(), alpha=0.6)
        # An empty ratio means the run had no checkpoint row to divide by: no point, never an invented 0.
        timed = [(t, float(r["time_vs_checkpoint"])) for t, r in zip(T, rs)
                 if r.get("time_vs_checkpoint") and r["seq_len"] in timed_lengths]
        if timed:
            time.plot([t for t, _ in timed], [x for _, x in timed], "o-", label=method)
    first = rows[0]
    what = f"{first.get('objective', 'sft')}, B={first.get('batch_size', 1)}"
    if first.get("lora"):
        what += f", LoRA {first['lora']}"
    mem.set(xlabel="sequence length T", ylabel="peak memory (GiB); dashed: analytic model",
            title=f"{first['preset']} {first['dtype']}, {what}"[:90])
    time.set(xlabel="sequence length T", ylabel="BP time / checkpointing (same run)", title="BP time ratio")
    mem.legend(fontsize=7)
    if time.lines:
        time.legend(fontsize=7)
    else:
        has_checkpoint = any(r["method"] == "checkpoint" for r in rows)
        why = "checkpointing over the budget (oom) at every T" if has_checkpoint else "no checkpoint row in this run"
        time.text(0.5, 0.5, why + ":\nno time ratio", ha="center", va="center", transform=time.transAxes)
    fig.suptitle(f"commit {first['commit']}, {first['date']}, {first['threads']} threads", fontsize=8)
    return save(fig, csv_path.with_suffix(".png"))


def plot_xy(csv_path: Path, x, x_label: str, y_columns, title: str, group=lambda r: r["method"]) -> Path:
    """One panel per (column, label, scale) in y_columns, a line per group; x: a column name or a function of the
    row (None: the row is not drawn); empty cells are skipped."""
    x_of = (lambda r: int(r[x])) if isinstance(x, str) else x
    rows = list(csv.DictReader(csv_path.open()))
    fig, axes = plt.subplots(1, len(y_columns), figsize=(5.5 * len(y_columns), 4))
    for ax, (column, label, scale) in zip(axes, y_columns):
        curves = defaultdict(list)
        for r in rows:
            if r.get(column) and x_of(r) is not None:
                curves[group(r)].append((x_of(r), float(r[column]) * scale))
        for name, points in sorted(curves.items()):
            points.sort()
            ax.plot([x for x, _ in points], [y for _, y in points], "o-", label=name)
        ax.set(xscale="log", xlabel=x_label, ylabel=label)
        ax.legend(fontsize=7)
    first = rows[0]
    fig.suptitle(f"{title} — {first['preset']} {first['dtype']}, commit {first['commit']}, {first['date']}, "
                 f"{first['threads']} threads", fontsize=8)
    return save(fig, csv_path.with_suffix(".png"))


def human_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def plot_profile(csv_path: Path) -> Path:
    """Fig. 1/8: live bytes by category over consecutive steps, one panel per method, same y scale."""
    rows = list(csv.DictReader(csv_path.open()))
    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4), sharey=True, squeeze=False)
    for ax, r in zip(axes[0], rows):
        timeline = list(csv.reader((csv_path.parent / (r["timeline"] + ".timeline.csv")).open()))
        header, events = timeline[0], timeline[1:]
        categories = header[3:]
        step = max(1, len(events) // 4000)  # enough points for the shape, not one per allocation
        events = events[::step] + [events[-1]]
        t = [float(e[0]) for e in events]
        ax.stackplot(t, *[[int(e[3 + i]) / 2**30 for e in events] for i in range(len(categories))],
                     labels=categories, step="post")
        ax.set(xlabel="seconds", title=f"{r['method']}\npeak {human_bytes(int(r['peak_bytes']))}, "
                                        f"model {human_bytes(int(r['model_peak_bytes']))}")
    axes[0][0].set_ylabel("live bytes (GiB)")
    axes[0][0].legend(fontsize=7, loc="upper left")
    first = rows[0]
    fig.suptitle(f"memory over {first['steps']} steps — {first['preset']} {first['dtype']}, T={first['seq_len']}, "
                 f"B={first['batch_size']}, commit {first['commit']}, {first['date']}; categories by allocating phase "
                 f"and lifetime (profile --help)", fontsize=8)
    return save(fig, csv_path.with_suffix(".png"))


def spec_options(spec: str) -> dict:
    """'streambp:layer_chunk=32,head_chunk=8' -> {'layer_chunk': 32, 'head_chunk': 8}"""
    _, _, options = spec.partition(":")
    return {k: int(v) for k, v in (kv.split("=") for kv in options.split(",") if kv)}


def plot_verify(csv_path: Path):
    """Error of every StreamBP run of a verify sweep against the number of layer chunks, beside standard BP's."""
    rows = list(csv.DictReader(csv_path.open()))
    if not rows or "max_l2_rel" not in rows[0]:
        return None  # written before the l2 column existed
    whole = [r for r in rows if r["group"] == "all"]
    streams = [r for r in whole if r["method"].startswith("streambp")]
    if len({r["method"] for r in streams}) < 2:
        return None  # one StreamBP spec is a table, not a curve
    T = int(rows[0]["seq_len"])
    fig, (oracle_ax, paper_ax) = plt.subplots(1, 2, figsize=(11, 4))
    panels = ((oracle_ax, "fp64", "max_l2_rel", "largest per-tensor l2 error vs fp64 oracle"),
              (paper_ax, "base32", "er_rel", "Er_rel vs base32 (paper's Table 7), all tensors"))
    for ax, reference, column, ylabel in panels:
        for dtype, marker in (("bf16", "o"), ("fp32", "s")):
            curves = defaultdict(list)
            for r in streams:
                if r["reference"] == reference and r["dtype"] == dtype:
                    o = spec_options(r["method"])
                    curves[o.get("head_chunk")].append((math.ceil(T / o["layer_chunk"]), float(r[column])))
            for head_chunk, points in sorted(curves.items()):
                points.sort()
                ax.plot([x for x, _ in points], [y for _, y in points], marker + "-",
                        label=f"StreamBP {dtype}, head_chunk={head_chunk}")
            for r in whole:
                if r["method"] == "standard" and r["reference"] == reference and r["dtype"] == dtype \
                        and float(r[column]) > 0:
                    ax.axhline(float(r[column]), ls="--", lw=1, color="k" if dtype == "bf16" else "grey",
                               label=f"standard BP {dtype}")
        ax.set(xscale="log", yscale="log", xlabel=f"layer chunks (T = {T})", ylabel=ylabel)
        ax.legend(fontsize=7)
    first = rows[0]
    fig.suptitle(f"{first['preset']} {first['objective']}: gradient error vs chunk count — commit {first['commit']}, "
                 f"{first['date']}", fontsize=8)
    return save(fig, csv_path.with_suffix(".png"))


def plot_grid(folder: Path):
    """The memory grid (`reproduce memory-grid`): measured / modelled peak of every run, by T, one panel per dtype."""
    rows = []
    for f in sorted(folder.glob("seq-*.csv")):
        rows += [r for r in csv.DictReader(open(f)) if r.get("peak_over_model")]
    if not rows:
        return None
    out = folder / (sorted(folder.glob("seq-*.csv"))[-1].stem.replace("seq-", "grid-") + ".png")
    if out.exists():
        return None
    dtypes = sorted({r["dtype"] + (" LoRA" if r.get("lora") else "") for r in rows})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(4.2 * len(dtypes), 3.6), sharey=True, squeeze=False)
    # Every method family in the data (a new method needs no edit here), each with its own marker.
    families = sorted({r["method"].split(":")[0] for r in rows})
    markers = dict(zip(families, "osD^vP*Xhp<>"))
    for ax, dt in zip(axes[0], dtypes):
        for family, marker in markers.items():
            pts = [r for r in rows if r["dtype"] + (" LoRA" if r.get("lora") else "") == dt
                   and r["method"].split(":")[0] == family]
            ax.scatter([int(r["seq_len"]) for r in pts], [float(r["peak_over_model"]) for r in pts], marker=marker,
                       s=18, alpha=0.7, label=family)
        ax.axhspan(0.97, 1.03, color="0.9", zorder=0)
        ax.set_xscale("log", base=2)
        ax.set_title(dt)
        ax.set_xlabel("sequence length T")
    axes[0][0].set_ylabel("measured / modelled peak")
    axes[0][0].legend(fontsize=7)
    outside = sum(abs(float(r["peak_over_model"]) - 1) > 0.03 for r in rows)
    fig.suptitle(f"memory models on the grid: {len(rows)} runs, {outside} outside 3% (band)")
    return save(fig, out)


def plot_training(folder: Path) -> Path:
    """Loss per step of every `train --metrics` CSV in `folder` (one run each), and each run's difference to the
    first one in name order that is fp32 (the reference trajectory), when there is one."""
    runs = {}
    for csv_path in sorted(folder.glob("*.csv")):
        rows = list(csv.DictReader(csv_path.open()))
        if rows and "grad_norm" in rows[0]:
            runs[csv_path.stem] = ([int(r["step"]) for r in rows], [float(r["loss"]) for r in rows])
    reference = next((name for name in runs if name.startswith("fp32")), None)
    fig, axes = plt.subplots(1, 2 if reference else 1, figsize=(11 if reference else 6, 4), squeeze=False)
    loss_ax = axes[0][0]
    for name, (steps, losses) in runs.items():
        loss_ax.plot(steps, losses, "-" if "streambp" in name else "--", label=name)
    loss_ax.set(xlabel="optimizer step", ylabel="loss", title=f"training loss: {folder.name}"[:80])
    loss_ax.legend(fontsize=7)
    if reference:
        ref = dict(zip(*runs[reference]))
        diff_ax = axes[0][1]
        for name, (steps, losses) in runs.items():
            if name == reference:
                continue
            diff_ax.plot(steps, [abs(l - ref[s]) for s, l in zip(steps, losses)], "-" if "streambp" in name else "--",
                         label=name)
        diff_ax.set(xlabel="optimizer step", ylabel=f"|loss - {reference}|", yscale="log",
                    title="distance to the fp32 trajectory")
        diff_ax.legend(fontsize=7)
    return save(fig, folder / "loss.png")


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "results")
    gib = 1 / 2**30
    makers = {
        "demo": plot_demo,
        "seq": plot_demo,
        "batch": lambda p: plot_xy(p, "batch_size", "batch size B", [
            ("seconds_per_sample", "BP seconds per sample", 1), ("peak_bytes", "peak memory (GiB)", gib)],
            "per-sample BP time vs batch size (Table 2)"),
        "partition": lambda p: plot_xy(p, lambda r: spec_options(r["method"]).get("layer_chunk"), "layer chunk size", [
            ("time_vs_checkpoint", "BP time / checkpointing (same run)", 1), ("peak_bytes", "peak memory (GiB)", gib)],
            "StreamBP's chunk sizes (Fig. 5)",
            group=lambda r: f"head_chunk={spec_options(r['method']).get('head_chunk')}, T={r['seq_len']}"),
        "toy": lambda p: plot_xy(p, "partitions", "partitions D (1 = standard BP)", [
            ("peak_bytes", "peak memory (GiB)", gib), ("intermediate_bytes", "intermediate memory (GiB)", gib),
            ("time_vs_standard", "time / standard (same implementation)", 1)],
            "two-linear-layer toy (Table 6)", group=lambda r: r["impl"]),
        "profile": plot_profile,
    }
    for stem, make in makers.items():
        for csv_path in sorted(root.glob(f"*/{stem}-*.csv")):
            if csv_path.name.endswith(".timeline.csv") or csv_path.parent.name == "grid":
                continue  # a profile's per-method timeline, drawn with its summary; the grid is drawn as one
            if not csv_path.with_suffix(".png").exists():  # figures are derived; never redraw over an existing one
                print("wrote", make(csv_path))
    if (root / "grid").is_dir():
        out = plot_grid(root / "grid")
        if out:
            print("wrote", out)
    for folder in sorted(root.glob("train-*/*/")):
        if any(folder.glob("*.csv")) and not (folder / "loss.png").exists():
            print("wrote", plot_training(folder))
    for csv_path in sorted(root.glob("*/verify-*.csv")):
        if not csv_path.with_suffix(".png").exists():
            out = plot_verify(csv_path)
            if out:
                print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
