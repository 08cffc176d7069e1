"""Packed batches through the CLI, as a user meets them (ARCHITECTURE.md §3 "Packed rows"):
- `run --pack` makes random packed rows; its --save-batch file carries both spellings of the boundaries, and a
  --batch-file with either one alone (position_ids as DataCollatorWithFlattening writes them, without an
  attention_mask; cu_seqlens; HF's cu_seq_lens_q/k with max_length_q/k) runs the same step to the bit;
- every malformed boundary exits 2 naming the row and the position, and writes no output file: positions that do not
  count 0, 1, 2, ..., an empty sequence, a sequence past the batch or across a row's end, a label across a boundary,
  two spellings that disagree;
- GRPO on packed rows (one completion per sequence, one advantage per sequence): `run --pack` and its --save-batch
  file through another method give the same step; advantages per row, and a completion token on a sequence's first
  position, exit 2 naming the tensor, the row and the position;
- DPO refuses packed rows saying why; --pack refuses what it cannot honour, in run, maxlen, project and pack-gain.

Usage: python tests/cli/cli_packed_batches.py BUILD/streambp   (needs torch + safetensors: the venv's python)
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import torch
    from safetensors.torch import load_file, save_file
except ImportError as e:  # an oracle that cannot run fails: a CI without its oracles is not green
    print(f"FAIL: missing oracle dependency: {e}")
    sys.exit(1)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from cli_helpers import FAILURES, expect_rejected, report, run  # noqa: E402

TINY = ["--preset", "tiny", "--method", "standard", "--dtype", "fp64", "--seed", "3"]


def variant(work, source, name, change):
    tensors = load_file(str(source))
    change(tensors)
    path = work / name
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def loss_of(binary, work, *args, method="standard"):
    record = work / "loss.json"
    record.unlink(missing_ok=True)
    common = [a if a != "standard" else method for a in TINY]  # TINY's --method standard, or `method`
    p = run(binary, *common, *args, "--json", record)
    if p.returncode != 0:
        FAILURES.append(f"run {' '.join(map(str, args))}: exit {p.returncode}\n{p.stdout}{p.stderr}")
        return None
    return json.loads(record.read_text())["loss"]


def main():
    binary = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        packed = work / "packed.safetensors"
        p = run(binary, *TINY, "--pack", "uniform:min=1,max=9", "--batch", "2", "--seq", "24", "--save-batch", packed)
        if p.returncode != 0 or "packed:" not in p.stdout:
            print(p.stdout + p.stderr)
            return 1
        b = load_file(str(packed))
        starts = (b["position_ids"][1] == 0).nonzero().flatten().tolist()
        assert len(starts) >= 2, starts
        boundary = starts[1]  # row 1's second sequence starts here
        loss = loss_of(binary, work, "--batch-file", packed)

        def keep_only(*names):
            return lambda t: [t.pop(k) for k in [k for k in t if k not in names]]

        def hf_flash_kwargs(t):
            cu = t.pop("cu_seqlens")
            t["cu_seq_lens_q"], t["cu_seq_lens_k"] = cu, cu.clone()
            t.pop("position_ids")
            longest = (cu[1:] - cu[:-1]).max().reshape(1).to(torch.int64)
            t["max_length_q"], t["max_length_k"] = longest, longest.clone()

        forms = {"position_ids alone, no attention_mask": keep_only("input_ids", "labels", "position_ids"),
                 "cu_seqlens alone": keep_only("input_ids", "attention_mask", "labels", "cu_seqlens"),
                 "HF's cu_seq_lens_q/k and max_length_q/k": hf_flash_kwargs}
        for what, change in forms.items():
            got = loss_of(binary, work, "--batch-file", variant(work, packed, "form.safetensors", change))
            if got != loss:
                FAILURES.append(f"{what}: loss {got}, the saved batch's {loss}")
            else:
                print(f"ok: {what}: the same step (loss {got})")

        third = (b["position_ids"][1] == 2).nonzero().flatten()[0].item()  # a sequence's third token in row 1

        def skipped_position(t):  # counts 0, 1, 3 (a position left out)
            t["position_ids"][1, third] = 3
            t.pop("cu_seqlens")

        def not_from_zero(t):
            t["position_ids"][0] += 1
            t.pop("cu_seqlens")

        def empty_sequence(t):
            cu = t.pop("cu_seqlens")
            t["cu_seqlens"] = torch.cat([cu[:2], cu[1:]])
            t.pop("position_ids")

        def past_the_batch(t):
            t["cu_seqlens"][-1] += 5
            t.pop("position_ids")

        def across_rows(t):  # row 0's last sequence runs into row 1
            cu = t.pop("cu_seqlens")
            t["cu_seqlens"] = cu[cu != 24]
            t.pop("position_ids")

        def kept_separator(t):
            t["labels"][1, boundary] = t["input_ids"][1, boundary]

        def disagreeing(t):  # position_ids run on over row 1's boundary, cu_seqlens keep it
            end = starts[2] if len(starts) > 2 else 24
            t["position_ids"][1, boundary:end] = torch.arange(end - boundary) + t["position_ids"][1, boundary - 1] + 1

        bad = [("position_ids that skip a position", skipped_position, [f"row 1, position {third} is 3 after 1"]),
               ("position_ids not starting at 0", not_from_zero, ["row 0, position 0 is 1"]),
               ("an empty sequence", empty_sequence, ["cu_seqlens[2]", "empty"]),
               ("a sequence past the batch", past_the_batch, ["past the batch's 48 tokens"]),
               ("a sequence across a row's end", across_rows, ["runs past the end of its row"]),
               ("a label across a boundary", kept_separator,
                [f"row 1, position {boundary}: labels there is a target across a sequence boundary"]),
               ("position_ids and cu_seqlens that disagree", disagreeing, [f"disagree in row 1 at position {boundary}"])]
        for what, change, patterns in bad:
            expect_rejected(binary, work, what, ["bad.safetensors", *patterns],
                            [*TINY, "--batch-file", variant(work, packed, "bad.safetensors", change)])
        expect_rejected(binary, work, "--pack with dpo", ["dpo: packed rows", "not defined for it", "across packs"],
                        [*TINY, "--objective", "dpo", "--pack", "fixed:length=4", "--batch", "4", "--seq", "8"])
        # GRPO: a random packed batch, read back through StreamBP, the same step; its bad per-sequence inputs.
        grpo = ["--objective", "grpo:loss_type=grpo,importance=sequence,beta=0.04"]
        grpo_packed = work / "grpo.safetensors"
        p = run(binary, *TINY, *grpo, "--pack", "uniform:min=1,max=9", "--group", "2", "--batch", "2", "--seq", "24",
                "--save-batch", grpo_packed)
        if p.returncode != 0:
            FAILURES.append(f"run --pack with grpo: exit {p.returncode}\n{p.stdout}{p.stderr}")
        else:
            g = load_file(str(grpo_packed))
            n = len(g["cu_seqlens"]) - 1
            if g["advantages"].shape != (n,):
                FAILURES.append(f"grpo --save-batch: advantages {tuple(g['advantages'].shape)}, expected ({n},)")
            base = loss_of(binary, work, *grpo, "--batch-file", grpo_packed)
            streamed = loss_of(binary, work, *grpo, "--batch-file", grpo_packed,
                               method="streambp:layer_chunk=5,head_chunk=7")
            if base is None or streamed is None or abs(base - streamed) > 1e-12 * abs(base):
                FAILURES.append(f"grpo packed batch file: standard loss {base}, streambp {streamed}")
            else:
                print(f"ok: grpo on a packed batch file: standard and streambp agree (loss {base})")

            def per_row_advantages(t):
                t["advantages"] = t["advantages"][:2].clone()

            g_starts = (g["position_ids"][1] == 0).nonzero().flatten().tolist()

            def completion_on_first_token(t):
                t["completion_mask"][1, g_starts[1]] = 1

            for what, change, patterns in [
                    ("grpo advantages per row", per_row_advantages,
                     ["advantages has shape [2]", f"one advantage per packed sequence, in the order of cu_seqlens ([{n}]"]),
                    ("grpo completion on a sequence's first token", completion_on_first_token,
                     [f"row 1, position {g_starts[1]}: completion_mask is 1 on a packed sequence's first token"])]:
                expect_rejected(binary, work, what, ["bad.safetensors", *patterns],
                                [*TINY, *grpo, "--batch-file", variant(work, grpo_packed, "bad.safetensors", change)])
        expect_rejected(binary, work, "--pack with --batch-file", ["--pack makes a random batch"],
                        [*TINY, "--pack", "fixed:length=4", "--batch-file", packed])
        expect_rejected(binary, work, "--pack with --pad-fraction", ["--pad-fraction with --pack"],
                        [*TINY, "--pack", "fixed:length=4", "--pad-fraction", "0.2", "--seq", "8"])
        expect_rejected(binary, work, "an unknown length distribution", ["unknown length distribution 'zipf'"],
                        [*TINY, "--pack", "zipf:s=1", "--seq", "8"])
        # The other commands that take --pack (maxlen, project, pack-gain): what they cannot honour is exit 2 too.
        small = ["--preset", "tiny", "--threads", "1"]
        for what, patterns, args in [
                ("pack-gain without --pack", ["--pack DIST is required"],
                 ["pack-gain", *small, "--method", "streambp", "--seq", "16"]),
                ("pack-gain --pack with dpo", ["--objective: ", "packed rows"],
                 ["pack-gain", *small, "--method", "streambp", "--seq", "16", "--objective", "dpo", "--pack", "fixed:length=4"]),
                ("maxlen --pack with --nproc", ["--pack with --nproc 2"],
                 ["maxlen", *small, "--budget-bytes", "4000000", "--optimizer", "adamw", "--batch", "2", "--nproc", "2",
                  "--pack", "fixed:length=64", "--model-only"]),
                ("maxlen --pack with dpo", ["--pack: ", "packed rows"],
                 ["maxlen", *small, "--budget-bytes", "4000000", "--objective", "dpo", "--pack", "fixed:length=64",
                  "--model-only"]),
                ("project --pack with --sp", ["--pack with --sp"], ["project", "--sp", "8", "--pack", "fixed:length=64"])]:
            p = subprocess.run([binary, *args], capture_output=True, text=True)
            text = p.stdout + p.stderr
            problems = [f"exit {p.returncode}, expected 2"] if p.returncode != 2 else []
            problems += [f"no '{s}' in the message" for s in patterns if s not in text]
            if problems:
                FAILURES.append(f"{what}: {'; '.join(problems)}\n{text}")
            else:
                print(f"ok: {what}: {text.strip().splitlines()[-1]}")
    return report()


if __name__ == "__main__":
    sys.exit(main())
