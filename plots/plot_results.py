"""Figures from results/ (read-only): peak memory and BP time ratio vs sequence length, one figure per demo or
`sweep seq` CSV; per-sample time and peak vs batch size (`sweep batch`); time and peak vs StreamBP's chunk sizes
(`sweep partition`); the linear toy's bytes and time vs partitions (`toy`); live bytes by category over two steps
(`profile`, Fig. 1/8); gradient error vs chunk count, one figure
per `streambp verify` CSV that sweeps StreamBP's chunks; training loss curves of the runs side by side, one figure
per folder of `train --metrics` CSVs (<run>/loss.png).

Usage: python plots/plot_results.py [results_dir] [--out DIR]
Writes <DIR>/<kind>/<csv stem>.png for each CSV of <results_dir>/<kind>/, redrawn on every call. DIR defaults to the
checkout's figures/, which git ignores: a read-only step over old results adds no file beside them (issue #44).
"""
import argparse
import math
import csv
import statistics
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "figures"


def save(fig, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    fig.savefig(out, dpi=120, bbox_inches="tight")  # "tight": the legends sit outside the axes
    plt.close(fig)
    return out


def read_rows(csv_path: Path):
    with csv_path.open() as f:
        return list(csv.DictReader(f))


def spec_options(spec: str) -> dict:
    """'streambp:layer_chunk=32,head_chunk=8' -> {'layer_chunk': 32, 'head_chunk': 8}"""
    _, _, options = spec.partition(":")
    return {k: int(v) for k, v in (kv.split("=") for kv in options.split(",") if kv)}


def streams_at(method: str, T: int) -> bool:
    """False when `method` is StreamBP with a chunk of T or more: that part is the whole sequence, nothing streams
    (the harness's streambp_chunk_advice says the same on the console)."""
    if not method.startswith("streambp"):
        return True
    o = spec_options(method)
    return o.get("layer_chunk", 512) < T and o.get("head_chunk", 1024) < T


def doubling(lengths) -> bool:
    """Every length twice the one before: a log2 axis spaces them evenly."""
    ts = sorted(set(lengths))
    return len(ts) >= 2 and all(b == 2 * a for a, b in zip(ts, ts[1:]))


def byte_unit(largest: int):
    """The unit of a byte axis whose largest value is `largest`: ("GiB", 2**30) or ("MiB", 2**20)."""
    return ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)


def legend_below(ax, **kwargs):
    """A legend under the axes, off the data."""
    return ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=7, frameon=False, **kwargs)


SHARED_MARKER = "*"  # the console marks a ratio timed on a shared machine with *; the figure with this marker


def draw_demo(rows):
    """Peak memory (measured, model as markers on top) and BP time / checkpointing against T: the Figure."""
    # A time ratio exists only where the same run measured checkpointing at that T (files written before empty cells
    # were introduced hold 0 there instead: never plotted).
    timed_lengths = {r["seq_len"] for r in rows if r["method"] == "checkpoint" and r["status"] != "oom"}
    by_method = defaultdict(lambda: defaultdict(list))  # method -> T -> rows (several: repeats, ranks, resumes)
    for r in rows:
        by_method[r["method"]][int(r["seq_len"])].append(r)
    lengths = sorted({int(r["seq_len"]) for r in rows})
    unit, scale = byte_unit(max(int(r[c]) for r in rows for c in ("peak_bytes", "model_peak_bytes") if r[c]))
    fig, (mem, time) = plt.subplots(1, 2, figsize=(12, 4.6), layout="constrained")
    colors = {}
    not_streaming, shared, spread = [], [], False
    for method, at in by_method.items():
        T = sorted(at)
        # oom rows (over the sweep's budget) have no measured peak: only the model is drawn there.
        peaks = {t: [int(r["peak_bytes"]) / scale for r in at[t] if r["peak_bytes"]] for t in T}
        measured = [t for t in T if peaks[t]]
        oom = [t for t in T if any(r["status"] == "oom" for r in at[t])]
        label = method + (f"; oom at T = {', '.join(map(str, oom))}" if oom else "")
        line, = mem.plot(measured, [max(peaks[t]) for t in measured], "o-", lw=2, label=label, zorder=2)
        colors[method] = line.get_color()
        lows = [max(peaks[t]) - min(peaks[t]) for t in measured]
        if any(lows):  # several rows at one T: their range
            spread = True
            mem.errorbar(measured, [max(peaks[t]) for t in measured], yerr=[lows, [0] * len(lows)], fmt="none",
                         ecolor=line.get_color(), capsize=3, zorder=2)
        # The model on top of the measurement, thin, so that both stay visible where they agree.
        mem.plot(T, [int(at[t][0]["model_peak_bytes"]) / scale for t in T], "x:", color="k", ms=7, mew=1.5, lw=0.8,
                 zorder=4)
        for t in measured:
            if not streams_at(method, t):
                not_streaming.append((t, max(peaks[t])))
        # An empty ratio means the run had no checkpoint row to divide by: no point, never an invented 0.
        timed = [t for t in T if str(t) in timed_lengths and any(r.get("time_vs_checkpoint") for r in at[t])]
        if not timed:
            continue
        ratio = {t: statistics.median(float(r["time_vs_checkpoint"]) for r in at[t] if r.get("time_vs_checkpoint"))
                 for t in timed}
        time.plot(timed, [ratio[t] for t in timed], "-", color=line.get_color(), label=method, zorder=2)
        for t in timed:
            is_shared = any(r.get("timing") == "shared" for r in at[t])
            time.plot([t], [ratio[t]], SHARED_MARKER if is_shared else "o", ms=13 if is_shared else 6,
                      color=line.get_color(), mec="k" if is_shared else line.get_color(), zorder=3,
                      gid="shared" if is_shared else "idle")
            if is_shared:
                shared.append(t)
            # The spread of the repeats: each repeat's time over checkpointing's median, same run.
            times = [float(x) for r in at[t] for x in r.get("bp_seconds_all", "").split()]
            if len(times) > 1 and float(at[t][0]["bp_seconds"]) > 0:
                per_second = ratio[t] / float(at[t][0]["bp_seconds"])
                lo, hi = min(times) * per_second, max(times) * per_second
                time.errorbar([t], [ratio[t]], yerr=[[ratio[t] - lo], [hi - ratio[t]]], fmt="none",
                              ecolor=line.get_color(), capsize=3, zorder=2)
                spread = True
    for t, peak in not_streaming:
        mem.plot([t], [peak], "o", ms=15, mfc="none", mec="red", mew=1.5, zorder=5, gid="not-streaming")
    annotate_reduction(mem, by_method, lengths)
    for ax in (mem, time) if time.lines else (mem,):
        if doubling(lengths):
            ax.set_xscale("log", base=2)
        if len(lengths) <= 10:  # the lengths measured, by name
            ax.set_xticks(lengths, [str(t) for t in lengths])
            ax.minorticks_off()
    mem.set_ylim(bottom=0, top=mem.get_ylim()[1] * 1.25)  # room for the reduction note, top left
    first = rows[0]
    what = f"{first.get('objective', 'sft')}, B={first.get('batch_size', 1)}"
    if first.get("lora"):
        what += f", LoRA {first['lora']}"
    if int(first.get("world_size") or 1) > 1:
        what += f" per rank of {first['world_size']} (ZeRO-{first.get('zero', 0)})"
    mem.set(xlabel="sequence length T", ylabel=f"peak memory ({unit}), weights included")
    mem.set_title("\n".join(textwrap.wrap(f"{first['preset']} {first['dtype']}, {what}", 60)), fontsize=9)
    handles, _ = mem.get_legend_handles_labels()
    handles.append(Line2D([], [], color="k", marker="x", ls=":", lw=0.8, label="analytic model"))
    if not_streaming:
        handles.append(Line2D([], [], marker="o", ms=12, mfc="none", mec="red", ls="",
                              label="a StreamBP chunk >= T: that part does not stream"))
    if spread:
        handles.append(Line2D([], [], color="grey", marker="|", ms=10, ls="", label="bars: range over repeats / rows"))
    legend_below(mem, handles=handles)
    time.set(xlabel="sequence length T", ylabel="BP time / checkpointing (same run)")
    time.set_title("BP time ratio", fontsize=9)
    if time.lines:
        time.axhline(1, color="0.7", lw=0.8, zorder=1)
        handles, _ = time.get_legend_handles_labels()
        if shared:
            handles.append(Line2D([], [], color="grey", marker=SHARED_MARKER, ms=12, mec="k", ls="",
                                  label="* timed while the machine was shared (timing=shared): the ratio is unreliable"))
        legend_below(time, handles=handles)
    else:
        has_checkpoint = any(r["method"] == "checkpoint" for r in rows)
        why = "checkpointing over the budget (oom) at every T" if has_checkpoint else "no checkpoint row in this run"
        time.text(0.5, 0.5, why + ":\nno time ratio", ha="center", va="center", transform=time.transAxes)
        time.set(xticks=[], yticks=[])
    fig.suptitle(f"commit {first['commit']}, {first['date']}, {first['threads']} threads", fontsize=8)
    return fig


def annotate_reduction(ax, by_method, lengths):
    """At the largest T with two measured peaks: how many times below checkpointing's (or the largest) each is."""
    for T in reversed(lengths):
        peaks = {m: max(int(r["peak_bytes"]) for r in at[T] if r["peak_bytes"])
                 for m, at in by_method.items() if any(r["peak_bytes"] for r in at.get(T, []))}
        if len(peaks) >= 2:
            break
    else:
        return
    reference = "checkpoint" if "checkpoint" in peaks else max(peaks, key=peaks.get)
    lines = [f"{m}: {peaks[reference] / p:.1f}x" for m, p in sorted(peaks.items(), key=lambda x: x[1])
             if m != reference and p < peaks[reference]]
    if lines:
        ax.text(0.02, 0.97, f"peak at T = {T}, times below {reference}'s:\n" + "\n".join(lines), transform=ax.transAxes,
                va="top", fontsize=7, gid="reduction", bbox=dict(facecolor="white", edgecolor="0.8", alpha=0.9))


def plot_demo(csv_path: Path, out: Path) -> Path:
    return save(draw_demo(read_rows(csv_path)), out)


def plot_xy(csv_path: Path, out: Path, x, x_label: str, y_columns, title: str, group=lambda r: r["method"]) -> Path:
    """One panel per (column, label, scale) in y_columns, a line per group; x: a column name or a function of the
    row (None: the row is not drawn); empty cells are skipped."""
    x_of = (lambda r: int(r[x])) if isinstance(x, str) else x
    rows = read_rows(csv_path)
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
    return save(fig, out)


def human_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# A category whose bytes never reach this share of the figure's scale is a band too thin to see: it is listed in a
# note under its panel instead.
VISIBLE_SHARE = 0.01
# The profile's phases, on the strip under every panel, in colours apart from the categories' (tab10).
PHASE_COLORS = {"forward": "0.6", "head": "#e5c494", "layer": "#66c2a5", "kv_recompute": "#fc8d62",
                "kv_path": "#8da0cb", "embedding": "#a6d854"}


def phase_segments(events):
    """[(phase, start, end)] of consecutive events in one named phase (events between phases have none)."""
    segments = []
    for e in events:
        t, phase = float(e[0]), e[1]
        if segments and segments[-1][0] == phase:
            segments[-1][2] = t
        else:
            segments.append([phase, t, t])
    return [(phase, start, end) for phase, start, end in segments if phase]


def draw_profile(csv_path: Path):
    """Fig. 1/8: live bytes by category over consecutive steps, one panel per method, same y scale; under each, the
    phases on a strip, the steps' forward/backward boundaries as lines through both: the Figure."""
    rows = read_rows(csv_path)
    timelines = []
    for r in rows:
        with (csv_path.parent / (r["timeline"] + ".timeline.csv")).open() as f:
            timeline = list(csv.reader(f))
        timelines.append((timeline[0][3:], timeline[1:]))
    top_bytes = max(int(e[2]) for _, events in timelines for e in events)
    unit, scale = byte_unit(top_bytes)
    top = top_bytes / scale
    categories = timelines[0][0]
    colors = dict(zip(categories, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig, axes = plt.subplots(2, len(rows), figsize=(6 * len(rows), 5.2), sharey="row", squeeze=False,
                             gridspec_kw={"height_ratios": [8, 1]}, layout="constrained")
    drawn = set()
    for column, (r, (names, events)) in enumerate(zip(rows, timelines)):
        ax, strip = axes[0][column], axes[1][column]
        peak = max(range(len(events)), key=lambda i: int(events[i][2]))
        step = max(1, len(events) // 4000)  # enough points for the shape, not one per allocation; the peak kept
        shown = sorted(set(range(0, len(events), step)) | {peak, len(events) - 1})
        t = [float(events[i][0]) for i in shown]
        largest = {c: max(int(e[3 + k]) for e in events) for k, c in enumerate(names)}
        visible = [c for c in names if largest[c] / scale >= VISIBLE_SHARE * top]
        ax.stackplot(t, *[[int(events[i][3 + names.index(c)]) / scale for i in shown] for c in visible],
                     labels=visible, colors=[colors[c] for c in visible], step="post")
        drawn.update(visible)
        ax.step(t, [int(events[i][2]) / scale for i in shown], where="post", color="k", lw=0.6, label="all live bytes")
        small = [c for c in names if c not in visible and largest[c] > 0]
        if small:
            strip.annotate("not drawn (each under 1% of the scale; the black line counts them): " +
                           ", ".join(f"{c} at most {human_bytes(largest[c])}" for c in small),
                           (0, 0), xycoords="axes fraction", xytext=(0, -36), textcoords="offset points", va="top",
                           fontsize=7, annotation_clip=False, gid="small-categories")
        segments = phase_segments(events)
        for phase, start, end in segments:
            strip.broken_barh([(start, max(end - start, 1e-9))], (0, 1), color=PHASE_COLORS.get(phase, "0.5"))
        # A step's forward ends where its first backward phase begins.
        for (phase, _, _), (after, start, _) in zip(segments, segments[1:]):
            if phase == "forward" and after != "forward":
                for a in (ax, strip):
                    a.axvline(start, color="k", ls="--", lw=1, label="forward | backward", gid="forward-backward")
        ax.set(title=f"{r['method']}\npeak {human_bytes(int(r['peak_bytes']))}, "
                     f"model {human_bytes(int(r['model_peak_bytes']))}")
        ax.tick_params(labelbottom=False)
        strip.set(xlabel="seconds", yticks=[], ylim=(0, 1))
        strip.sharex(ax)
    axes[0][0].set_ylabel(f"live bytes ({unit})")
    axes[0][0].set_ylim(0, top * 1.05)
    axes[1][0].set_ylabel("phase", rotation=0, ha="right", va="center")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[c]) for c in categories if c in drawn]
    labels = [c for c in categories if c in drawn]
    handles += [Line2D([], [], color="k", lw=0.6), Line2D([], [], color="k", ls="--", lw=1)]
    labels += ["all live bytes", "forward | backward"]
    phases = sorted({phase for _, events in timelines for phase, _, _ in phase_segments(events)},
                    key=lambda p: list(PHASE_COLORS).index(p) if p in PHASE_COLORS else len(PHASE_COLORS))
    handles += [plt.Rectangle((0, 0), 1, 1, color=PHASE_COLORS.get(p, "0.5")) for p in phases]
    labels += [f"phase: {p}" for p in phases]
    axes[0][-1].legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=7, frameon=False)
    first = rows[0]
    fig.suptitle(f"memory over {first['steps']} steps — {first['preset']} {first['dtype']}, T={first['seq_len']}, "
                 f"B={first['batch_size']}, commit {first['commit']}, {first['date']}; categories by allocating phase "
                 f"and lifetime (profile --help)", fontsize=8)
    return fig


def plot_profile(csv_path: Path, out: Path) -> Path:
    return save(draw_profile(csv_path), out)


def plot_verify(csv_path: Path, out: Path):
    """Error of every StreamBP run of a verify sweep against the number of layer chunks, beside standard BP's."""
    rows = read_rows(csv_path)
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
    return save(fig, out)


def plot_grid(folder: Path, out_dir: Path):
    """The memory grid (`reproduce memory-grid`): measured / modelled peak of every run, by T, one panel per dtype."""
    rows = []
    for f in sorted(folder.glob("seq-*.csv")):
        rows += [r for r in csv.DictReader(open(f)) if r.get("peak_over_model")]
    if not rows:
        return None
    out = out_dir / (sorted(folder.glob("seq-*.csv"))[-1].stem.replace("seq-", "grid-") + ".png")
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


def plot_training(folder: Path, out: Path) -> Path:
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
    return save(fig, out)


def main() -> int:
    parser = argparse.ArgumentParser(description="Figures of the CSVs under a results folder (read-only).")
    parser.add_argument("results", nargs="?", default="results", type=Path)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="where the figures go, as <out>/<kind>/<stem>.png (default: the checkout's figures/)")
    args = parser.parse_args()
    root, out_dir = args.results, args.out
    gib = 1 / 2**30
    makers = {
        "demo": plot_demo,
        "seq": plot_demo,
        "batch": lambda p, out: plot_xy(p, out, "batch_size", "batch size B", [
            ("seconds_per_sample", "BP seconds per sample", 1), ("peak_bytes", "peak memory (GiB)", gib)],
            "per-sample BP time vs batch size (Table 2)"),
        "partition": lambda p, out: plot_xy(
            p, out, lambda r: spec_options(r["method"]).get("layer_chunk"), "layer chunk size", [
                ("time_vs_checkpoint", "BP time / checkpointing (same run)", 1), ("peak_bytes", "peak memory (GiB)", gib)],
            "StreamBP's chunk sizes (Fig. 5)",
            group=lambda r: f"head_chunk={spec_options(r['method']).get('head_chunk')}, T={r['seq_len']}"),
        "toy": lambda p, out: plot_xy(p, out, "partitions", "partitions D (1 = standard BP)", [
            ("peak_bytes", "peak memory (GiB)", gib), ("intermediate_bytes", "intermediate memory (GiB)", gib),
            ("time_vs_standard", "time / standard (same implementation)", 1)],
            "two-linear-layer toy (Table 6)", group=lambda r: r["impl"]),
        "profile": plot_profile,
        "verify": plot_verify,
    }
    for stem, make in makers.items():
        for csv_path in sorted(root.glob(f"*/{stem}-*.csv")):
            if csv_path.name.endswith(".timeline.csv") or csv_path.parent.name == "grid":
                continue  # a profile's per-method timeline, drawn with its summary; the grid is drawn as one
            written = make(csv_path, out_dir / csv_path.relative_to(root).with_suffix(".png"))
            if written:
                print("wrote", written)
    if (root / "grid").is_dir():
        written = plot_grid(root / "grid", out_dir / "grid")
        if written:
            print("wrote", written)
    for folder in sorted(root.glob("train-*/*/")):
        if any(folder.glob("*.csv")):
            print("wrote", plot_training(folder, out_dir / folder.relative_to(root) / "loss.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
