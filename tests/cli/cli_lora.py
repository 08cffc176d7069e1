"""LoRA bad input through the CLI: an adapter for another base (shapes or names), rank <= 0, an unknown target,
--lora options that contradict the adapter's adapter_config.json, and PEFT options we do not implement all exit 2
with a message naming the file and the tensor or key, and write no output file.

Usage: python tests/cli/cli_lora.py BUILD/streambp   (needs torch + safetensors: the venv's python)
"""
import json
import shutil
import sys
import tempfile
from pathlib import Path

try:
    from safetensors.torch import load_file, save_file
except ImportError as e:  # an oracle that cannot run fails: a CI without its oracles is not green
    print(f"FAIL: missing oracle dependency: {e}")
    sys.exit(1)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from cli_helpers import FAILURES, expect_rejected, report, run  # noqa: E402

def edited_adapter(work, source, name, config_change=None, tensor_change=None):
    target = work / name
    shutil.copytree(source, target)
    if config_change:
        config = json.loads((target / "adapter_config.json").read_text())
        config_change(config)
        (target / "adapter_config.json").write_text(json.dumps(config))
    if tensor_change:
        tensors = load_file(str(target / "adapter_model.safetensors"))
        tensor_change(tensors)
        save_file(tensors, str(target / "adapter_model.safetensors"))
    return target


def main():
    binary = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base, adapter = work / "base", work / "adapter"
        common = ["--method", "standard", "--dtype", "fp64", "--seq", "12"]
        p = run(binary, "--preset", "tiny", *common, "--seed", "1", "--lora", "rank=4,alpha=8,targets=q,v,down",
                "--save-model", base, "--save-adapter", adapter)
        if p.returncode != 0:
            print(p.stdout + p.stderr)
            return 1
        # Another base: tiny's layout with a wider MLP.
        other = work / "other.json"
        other.write_text(json.dumps({"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
                                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                     "head_dim": 16, "tie_word_embeddings": True}))
        load = ["--load", base, *common]
        weights = str(adapter / "adapter_model.safetensors")
        expect_rejected(binary, work, "an adapter for another base (shape)",
                        [weights, "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight", "has shape"],
                        ["--config", other, *common, "--adapter", adapter])

        def rename(t):
            t["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"] = t.pop(
                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")

        renamed = edited_adapter(work, adapter, "renamed", tensor_change=rename)
        expect_rejected(binary, work, "an adapter with another tensor name",
                        [str(renamed / "adapter_model.safetensors"), "q_proj.lora_A.weight"],
                        [*load, "--adapter", renamed])
        expect_rejected(binary, work, "rank 0", ["--lora rank=0", "rank"], [*load, "--lora", "rank=0"])
        expect_rejected(binary, work, "negative rank", ["rank=-2"], [*load, "--lora", "rank=-2"])
        expect_rejected(binary, work, "an unknown target", ["unknown LoRA target 'attn'"],
                        [*load, "--lora", "rank=4,targets=q,attn"])
        expect_rejected(binary, work, "an unknown --lora key", ["unknown option 'dropout'"],
                        [*load, "--lora", "rank=4,dropout=0.1"])
        config_file = str(adapter / "adapter_config.json")
        expect_rejected(binary, work, "--lora rank contradicting adapter_config.json", [config_file, "key 'r' is 4", "rank=8"],
                        [*load, "--adapter", adapter, "--lora", "rank=8,alpha=8,targets=q,v,down"])
        expect_rejected(binary, work, "--lora alpha contradicting adapter_config.json", [config_file, "lora_alpha"],
                        [*load, "--adapter", adapter, "--lora", "rank=4,alpha=16,targets=q,v,down"])
        expect_rejected(binary, work, "--lora targets contradicting adapter_config.json", [config_file, "target_modules"],
                        [*load, "--adapter", adapter, "--lora", "rank=4,alpha=8,targets=all-linear"])
        dora = edited_adapter(work, adapter, "dora", config_change=lambda c: c.update(use_dora=True))
        expect_rejected(binary, work, "a DoRA adapter", [str(dora / "adapter_config.json"), "use_dora"],
                        [*load, "--adapter", dora])
        not_lora = edited_adapter(work, adapter, "ia3", config_change=lambda c: c.update(peft_type="IA3"))
        expect_rejected(binary, work, "another PEFT type", [str(not_lora / "adapter_config.json"), "peft_type"],
                        [*load, "--adapter", not_lora])
        expect_rejected(binary, work, "--save-adapter without LoRA", ["--save-adapter needs --lora or --adapter"],
                        [*load, "--save-adapter", work / "nothing"])
        # The positive twin: the adapter, with or without a matching --lora, loads and runs.
        for extra in ([], ["--lora", "rank=4,alpha=8,targets=q,v,down"]):
            p = run(binary, *load, "--adapter", adapter, *extra)
            if p.returncode != 0:
                FAILURES.append(f"loading the adapter {extra} failed:\n{p.stdout}{p.stderr}")
    return report()


if __name__ == "__main__":
    sys.exit(main())
