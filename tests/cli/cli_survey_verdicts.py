"""The survey's row verdict never passes a number that is not finite (issue #44): a case conform reported as passed
whose worst error or loss error is NaN or Inf (or missing) makes its row failed, naming the case; a NaN is the worst
error of a row; a time or memory ratio to HF over a NaN, an Inf or a 0 is an empty cell, not a number. Runs
experiments/survey/survey.py's summarize() on hand-made conform rows: no library, no binary.

Usage: python tests/cli/cli_survey_verdicts.py BUILD/streambp   (the binary is not used)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments" / "survey"))
from survey import summarize  # noqa: E402

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
    if FAILURES:
        print(f"FAIL: {len(FAILURES)} check(s)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
