"""The figures of plots/plot_results.py say what the numbers say (issue #44 item 6), built from small synthetic results
and judged on their matplotlib objects:
- memory vs T: y from 0, the model as markers above the measured lines, the reduction at the largest T written out,
  a log2 axis when T doubles, StreamBP points whose chunk is >= T marked, the spread of repeats drawn, the legend
  under the axes; the peak's label says the weights are in it;
- time ratio: a point the console marked * (timing=shared) has its own marker;
- memory profile: forward/backward lines and a phase strip, the legend outside the axes, categories too small to see
  listed in a note instead of drawn;
- `make plots` over a copy of results/ writes no file into it, and its default folder is ignored by git;
- docs/reproducing.md says that `profile`'s figure comes from `make plots`.

Usage: python tests/cli/cli_figures.py BUILD/streambp   (the venv's python: matplotlib; the binary is not used)
"""
import csv
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plots"))
import plot_results  # noqa: E402

FAILURES = []


def check(what, ok, detail=""):
    if ok:
        print(f"ok: {what}")
    else:
        FAILURES.append(f"{what} {detail}")


COMMON = {"commit": "abc", "date": "2026-11-28T00:00:00Z", "machine": "m", "threads": "2", "torch_version": "2.14.1",
          "preset": "tiny", "dtype": "fp32", "seed": "0", "objective": "sft", "lora": "", "batch_size": "1"}


def demo_rows():
    """checkpoint and a StreamBP whose chunk (1024) is >= T at 512 and 1024, at T = 512, 1024, 2048; the StreamBP
    ratio at 2048 timed on a shared machine; three repeats each; checkpointing's peak at 2048 in two rows."""
    rows = []
    for T in (512, 1024, 2048):
        for method, peak, seconds in (("checkpoint", 4e6 * T, [1.0, 1.1, 1.2]),
                                      ("streambp:layer_chunk=1024,head_chunk=1024", 1e6 + 2e5 * T, [0.8, 0.9, 1.3])):
            rows.append(dict(COMMON, method=method, status="unchecked", seq_len=str(T), peak_bytes=str(int(peak)),
                             model_peak_bytes=str(int(peak * 1.01)), bp_seconds=f"{seconds[1]:.4f}",
                             bp_seconds_all=" ".join(f"{s:.4f}" for s in seconds),
                             time_vs_checkpoint=f"{seconds[1] / 1.1:.4f}",
                             timing="shared" if T == 2048 else "idle"))
    rows.append(dict(rows[-2], peak_bytes=str(int(4e6 * 2048 * 0.9))))  # a second rank's row: a spread
    return rows


def write_csv(path, rows):
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def legend_outside(fig, ax, legend):
    """The legend's box does not overlap the axes' box (display coordinates, after a draw)."""
    fig.canvas.draw()
    return not legend.get_window_extent().overlaps(ax.get_window_extent())


def test_demo():
    rows = demo_rows()
    fig = plot_results.draw_demo(rows)
    mem, time = fig.axes[:2]
    check("memory axis starts at 0", mem.get_ylim()[0] == 0, mem.get_ylim())
    check("peak label counts the weights", "weights included" in mem.get_ylabel(), mem.get_ylabel())
    check("log2 x axis when T doubles", mem.get_xscale() == "log" and mem.xaxis.get_transform().base == 2,
          mem.get_xscale())
    measured = [l for l in mem.lines if l.get_linestyle() == "-"]
    model = [l for l in mem.lines if l.get_marker() == "x"]
    check("the model is drawn as markers above the measured lines",
          model and measured and min(l.get_zorder() for l in model) > max(l.get_zorder() for l in measured),
          [(l.get_label(), l.get_zorder(), l.get_marker()) for l in mem.lines])
    notes = [t.get_text() for t in mem.texts if t.get_gid() == "reduction"]
    check("the reduction at the largest T is written", notes and "T = 2048" in notes[0] and "x" in notes[0], notes)
    marked = [l for l in mem.lines if l.get_gid() == "not-streaming"]
    check("StreamBP points with a chunk >= T are marked (T = 512, 1024)",
          sorted(int(l.get_xdata()[0]) for l in marked) == [512, 1024], [l.get_xdata() for l in marked])
    check("the spread of several rows at one T is drawn", len(mem.collections) > 0)
    check("the memory legend is off the data", legend_outside(fig, mem, mem.get_legend()))
    shared = [l for l in time.lines if l.get_gid() == "shared"]
    idle = [l for l in time.lines if l.get_gid() == "idle"]
    check("a point timed on a shared machine has its own marker",
          shared and idle and {l.get_marker() for l in shared}.isdisjoint({l.get_marker() for l in idle}),
          [(l.get_gid(), l.get_marker()) for l in time.lines])
    check("the time legend explains the *", any("shared" in t.get_text() for t in time.get_legend().get_texts()))
    check("the repeats' spread of the time ratio is drawn", len(time.collections) > 0)
    plot_results.plt.close(fig)
    # Lengths that do not double: a linear axis.
    fig = plot_results.draw_demo([r for r in rows if r["seq_len"] != "1024"] +
                                 [dict(rows[0], seq_len="1536"), dict(rows[1], seq_len="1536")])
    check("a linear x axis when T does not double", fig.axes[0].get_xscale() == "linear")
    plot_results.plt.close(fig)


def test_profile(work):
    phases = [("forward", 0.0, 1.0), ("head", 1.0, 2.0), ("layer", 2.0, 3.0), ("kv_path", 3.0, 4.0)]
    categories = ["weights & batch", "gradients", "checkpoints / activations", "K/V", "logits / head", "working set"]
    timeline = [["seconds", "phase", "current_bytes"] + categories]
    for phase, start, end in phases * 1:
        for k in range(5):
            t = start + (end - start) * k / 5
            # K/V never above 1 KB of a 1 GB scale: too small to see; the head's logits large.
            live = [2**29, 2**28 if phase != "forward" else 0, 2**26, 1024, 2**29 if phase == "head" else 0, 2**24]
            timeline.append([f"{t:.3f}", phase, str(sum(live))] + [str(b) for b in live])
    for name in ("checkpoint", "streambp"):
        with (work / f"profile-x-{name}.timeline.csv").open("w", newline="") as f:
            csv.writer(f).writerows(timeline)
    summary = work / "profile-x.csv"
    write_csv(summary, [dict(COMMON, method=m, status="unchecked", seq_len="128", steps="1", peak_bytes=str(2**30),
                             model_peak_bytes=str(2**30), timeline=f"profile-x-{m}") for m in ("checkpoint", "streambp")])
    fig = plot_results.draw_profile(summary)
    panels = [ax for ax in fig.axes if ax.get_title()]
    strips = [ax for ax in fig.axes if not ax.get_title()]
    check("a forward/backward line in every panel",
          all(any(l.get_gid() == "forward-backward" and l.get_xdata()[0] == 1.0 for l in ax.lines) for ax in panels))
    check("a phase strip under every panel, one bar per phase",
          len(strips) == len(panels) and all(len(ax.collections) == len(phases) for ax in strips))
    legend = panels[-1].get_legend()
    check("the profile legend is outside the axes", legend and legend_outside(fig, panels[-1], legend))
    drawn = {t.get_text() for t in legend.get_texts()}
    notes = [t.get_text() for ax in fig.axes for t in ax.texts if t.get_gid() == "small-categories"]
    check("a category too small to see is in a note, not a band",
          "K/V" not in drawn and notes and all("K/V" in n for n in notes), (drawn, notes))
    plot_results.plt.close(fig)


def test_make_plots(work):
    """`make plots` on a copy of results/: figures go to --out, nothing new lands beside the results."""
    copy = work / "results"
    for kind in ("table5", "train-bf16"):  # a committed sweep without a figure beside it, and a training folder
        if (ROOT / "results" / kind).is_dir():
            shutil.copytree(ROOT / "results" / kind, copy / kind)
    (copy / "synthetic").mkdir(parents=True)
    write_csv(copy / "synthetic" / "seq-x.csv", demo_rows())
    for f in work.glob("profile-x*.csv"):  # test_profile's
        shutil.copy(f, copy / "synthetic")
    before = sorted(p for p in copy.rglob("*"))
    out = work / "figures"
    p = subprocess.run([sys.executable, str(ROOT / "plots" / "plot_results.py"), str(copy), "--out", str(out)],
                       capture_output=True, text=True)
    check("plot_results.py ran", p.returncode == 0, p.stdout + p.stderr)
    check("plot_results.py wrote nothing into the results", sorted(copy.rglob("*")) == before,
          set(copy.rglob("*")) - set(before))
    check("the figures are in --out, beside nothing", (out / "synthetic" / "seq-x.png").is_file() and
          (out / "synthetic" / "profile-x.png").is_file() and (out / "table5").is_dir(),
          sorted(str(x.relative_to(out)) for x in out.rglob("*.png")))
    if (ROOT / ".git").exists():
        default = plot_results.DEFAULT_OUT / "demo" / "demo-x.png"
        ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", str(default)]).returncode == 0
        check("make plots' default folder is ignored by git", ignored, default)


def test_profile_doc():
    """docs/reproducing.md says where `profile`'s stacked figure comes from (the command writes none itself)."""
    readme = (ROOT / "docs" / "reproducing.md").read_text()
    bullet = readme[readme.index("- `profile` records"):]
    bullet = bullet[:bullet.index("\n- ")]
    check("docs/reproducing.md's profile entry says the figure comes from `make plots`", "`make plots`" in bullet, bullet)


def main():
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        test_demo()
        test_profile(work)
        test_make_plots(work)
    test_profile_doc()
    for f in FAILURES:
        print("FAIL:", f)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
