"""GRPO/DPO bad input through the CLI, as a user meets it: every malformed batch file, missing or mismatched
reference model and bad objective spec exits 2 with a message naming the file and the tensor or key, and writes no
output file (no partial results).

Usage: python tests/cli/cli_objectives.py BUILD/streambp   (needs torch + safetensors: the venv's python)
"""
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

def spoiled(work, source, name, change):
    tensors = load_file(str(source))
    change(tensors)
    path = work / name
    save_file(tensors, str(path))
    return path


def main():
    binary = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, ref = work / "model", work / "ref"
        grpo, dpo = work / "grpo.safetensors", work / "dpo.safetensors"
        common = ["--method", "standard", "--dtype", "fp64"]
        for args in (["--preset", "tiny", "--seed", "1", "--save-model", model, "--objective", "grpo:beta=0.04",
                      "--batch", "4", "--group", "2", "--seq", "16", "--pad-fraction", "0.3", "--save-batch", grpo],
                     ["--preset", "tiny", "--seed", "2", "--save-model", ref, "--objective", "dpo", "--batch", "4",
                      "--seq", "16", "--save-batch", dpo]):
            p = run(binary, *common, *args)
            if p.returncode != 0:
                print(p.stdout + p.stderr)
                return 1
        # A reference with another vocabulary: the tiny preset's shape with V = 256.
        other = work / "other-vocab"
        p = run(binary, *common, "--config", write_config(work), "--seq", "8", "--save-model", other)
        assert p.returncode == 0, p.stdout + p.stderr
        load = ["--load", model, *common]

        def drop(name):
            return lambda t: t.pop(name)

        def pad_scored(t):
            t["attention_mask"][0, -1] = 0
            t["input_ids"][0, -1] = 0
            t["completion_mask"][0, -1] = 1

        def wrong_advantages(t):
            t["advantages"] = t["advantages"][:3].contiguous()

        def odd_rows(t):
            for k in ("input_ids", "attention_mask", "completion_mask"):
                t[k] = t[k][:3].contiguous()
            t["ref_logps"] = t["ref_logps"][:3].contiguous()

        g = "grpo:beta=0.04"
        expect_rejected(binary, work, "GRPO batch without advantages", ["no-adv.safetensors", "missing tensor 'advantages'"],
                        [*load, "--objective", g, "--batch-file", spoiled(work, grpo, "no-adv.safetensors", drop("advantages"))])
        expect_rejected(binary, work, "completion_mask on a pad", ["pad.safetensors", "completion_mask is 1 on a padded position"],
                        [*load, "--objective", g, "--batch-file", spoiled(work, grpo, "pad.safetensors", pad_scored)])
        expect_rejected(binary, work, "advantages of the wrong shape", ["adv3.safetensors", "advantages has shape"],
                        [*load, "--objective", g, "--batch-file", spoiled(work, grpo, "adv3.safetensors", wrong_advantages)])
        expect_rejected(binary, work, "DPO with an odd number of rows", ["odd.safetensors", "even number of rows"],
                        [*load, "--objective", "dpo", "--batch-file", spoiled(work, dpo, "odd.safetensors", odd_rows)])
        no_ref = spoiled(work, dpo, "no-ref.safetensors", drop("ref_logps"))
        expect_rejected(binary, work, "DPO without ref_logps or --ref", ["no-ref.safetensors", "needs ref_logps in the batch or --ref"],
                        [*load, "--objective", "dpo", "--batch-file", no_ref])
        expect_rejected(binary, work, "a reference of another vocabulary", [str(other), "vocab_size 256"],
                        [*load, "--objective", "dpo", "--batch-file", no_ref, "--ref", other])
        expect_rejected(binary, work, "--ref and ref_logps together", ["dpo.safetensors", "use one of them"],
                        [*load, "--objective", "dpo", "--batch-file", dpo, "--ref", ref])
        expect_rejected(binary, work, "--ref that the objective never reads", ["--ref", "reads no reference"],
                        [*load, "--objective", "grpo:beta=0", "--batch-file", spoiled(work, grpo, "beta0.safetensors", drop("ref_logps")),
                         "--ref", ref])
        expect_rejected(binary, work, "a GRPO batch run as SFT", ["grpo.safetensors", "missing tensor 'labels'"],
                        [*load, "--objective", "sft", "--batch-file", grpo])
        expect_rejected(binary, work, "an unknown objective key", ["unknown option 'betta'"],
                        [*load, "--objective", "grpo:betta=1", "--batch-file", grpo])
        expect_rejected(binary, work, "a bad loss_type", ["loss_type=ppo"],
                        [*load, "--objective", "grpo:loss_type=ppo", "--batch-file", grpo])
        expect_rejected(binary, work, "GRPO random batch with a group of one", ["--group must be >= 2"],
                        ["--preset", "tiny", *common, "--objective", "grpo", "--batch", "2", "--group", "1", "--seq", "8"])
        expect_rejected(binary, work, "DPO random batch with an odd --batch", ["must be even"],
                        ["--preset", "tiny", *common, "--objective", "dpo", "--batch", "3", "--seq", "8"])
        # The positive twin: the same reference, given properly, works.
        p = run(binary, *load, "--objective", "dpo", "--batch-file", no_ref, "--ref", ref)
        if p.returncode != 0:
            FAILURES.append(f"DPO with --ref failed:\n{p.stdout}{p.stderr}")
    return report()


def write_config(work):
    path = work / "v256.json"
    path.write_text('{"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, '
                    '"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, '
                    '"tie_word_embeddings": true, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}')
    return path


if __name__ == "__main__":
    sys.exit(main())
