"""The verdicts the Python summaries make of result rows never pass a number that is not finite (issue #44):
(a) the survey's row (experiments/survey/survey.py summarize, on hand-made conform rows): a case conform reported as
    passed whose worst error or loss error is NaN or Inf (or missing) makes its row failed, naming the case; a NaN is
    the worst error of a row; a time or memory ratio to HF over a NaN, an Inf or a 0 is an empty cell, not a number;
(b) the precision grid's re-judged statistic (experiments/precision_grid/summarize.py): a recorded NaN or Inf is +inf,
    a failure (an Inf in standard's error made it 0, a NaN was no failure).
No library, no binary.

Usage: python tests/cli/cli_nonfinite_rows.py BUILD/streambp   (the binary is not used)
"""
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "experiments" / "survey"), str(ROOT / "experiments" / "precision_grid")]
from survey import summarize  # noqa: E402
from summarize import statistic  # noqa: E402

ENTRY = {"name": "lib", "library": "lib", "version": "1", "setting": ""}
PROVENANCE = {"commit": "c", "date": "d", "machine": "m", "threads": "1", "torch_version": "t"}
FAILURES = []


def case(name, status="passed", worst="1.0e-12", loss="1e-13", dtype="fp64", seconds="2", problem=""):
    return {"case": name, "status": status, "worst": worst, "worst_tensor": f"{name}.w", "rule": "r",
            "loss_rel_error": loss, "seconds": seconds, "peak_rss_bytes": "100", "problem": problem, "lora": "",
            "objective": "sft", "dtype": dtype}


def row(*cases, hf=()):
    rows = summarize(ENTRY, list(cases), list(hf), "cmd", {}, PROVENANCE)
    assert len(rows) == 1, rows
    return rows[0]


def expect(what, got, **want):
    wrong = {k: (got[k], v) for k, v in want.items() if got[k] != v}
    if wrong:
        FAILURES.append(f"{what}: {wrong}")
        print(f"FAIL: {what}: (got, wanted) {wrong}")
    else:
        print(f"ok: {what}: {', '.join(f'{k}={got[k]!r}' for k in want)}")


def expect_in(what, text, part):
    if part not in text:
        FAILURES.append(f"{what}: '{part}' not in '{text}'")
        print(f"FAIL: {what}: '{part}' not in '{text}'")
    else:
        print(f"ok: {what}: {text}")


def main():
    expect("finite passed cases (the control)", row(case("a"), case("b")), status="passed", verdict="exact")
    for bad in ("nan", "inf", "-nan", ""):
        got = row(case("a"), case("b", worst=bad))
        expect(f"a passed case with worst '{bad}'", got, status="failed")
        expect_in(f"its cause, worst '{bad}'", got["cause"], "b: passed by conform with worst")
    for bad in ("nan", "inf"):
        got = row(case("a"), case("b", loss=bad))
        expect(f"a passed case with loss error '{bad}'", got, status="failed", verdict="wrong loss, gradients exact")
    got = row(case("a", status="failed", worst="3e-6", problem="off"), case("b", status="failed", worst="nan", problem="x"))
    expect("a NaN is the worst error of a row", got, status="failed", worst="nan", worst_tensor="b.w", verdict="wrong")
    got = row(case("a", status="failed", worst="3e-6", problem="normwise 3e-6"))
    expect("a finite failure keeps conform's cause", got, cause="normwise 3e-6")
    hf = [case("a", seconds="nan"), case("b", seconds="0"), case("c", seconds="inf")]
    expect("time ratios over NaN, 0 and Inf are empty", row(case("a"), case("b"), case("c"), hf=hf), seconds_vs_hf="")
    expect("a ratio skips the non-finite ones", row(case("a", seconds="nan"), case("b", seconds="4"),
                                                    hf=[case("a"), case("b")]), seconds_vs_hf="2.00")

    # (b) a recorded row of results/rule/ (fp32 StreamBP, the embedding's gradient): statistic 0.31.
    grid_row = {"precision": "fp32", "method_l2_beside_scale": "3.291029e-07", "standard_l2_beside_scale": "3.290629e-07",
                "floor": "3.888705e-11", "allowance": "3.1783", "statistic": "0.3147", "method_scale": "8.461771e-09",
                "standard_run_error": "3.447299e-07", "scale_allowance": "14.6749", "scale_statistic": "0.0017"}
    control = statistic(dict(grid_row))
    expect("a recorded grid row (the control)", {"statistic": round(control, 2)}, statistic=0.31)
    for key in ("standard_l2_beside_scale", "method_l2_beside_scale", "statistic", "scale_statistic"):
        for bad in ("nan", "inf"):
            expect(f"a grid row with {key} = {bad}", {"statistic": statistic({**grid_row, key: bad})}, statistic=math.inf)
    if FAILURES:
        print(f"FAIL: {len(FAILURES)} check(s)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
