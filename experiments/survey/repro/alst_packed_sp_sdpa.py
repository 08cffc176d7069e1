#!/usr/bin/env python3
"""ALST's packed samples under Ulysses sequence parallelism on SDPA, with DeepSpeed alone (issue #59, item 5).

ArcticTraining 0.8.0 packs SFT samples into one row (data/sft_factory.py pack_sft_batch: position_ids restart at 0
per sample, no attention mask) and, at sequence_parallel_size > 1, runs DeepSpeed's UlyssesSPAttentionHF around the
model's attention (trainer/trainer.py lines 191-198), SDPA being its default (config/model.py line 48); on SDPA it
also stops transformers from building any mask (trainer.py lines 225-231). DeepSpeed's wrapper drops whatever mask it
is given (0.19.8 runtime/sequence_parallel/ulysses_sp.py, uattn_wrapper) and gathers position_ids, which SDPA never
reads: transformers' sdpa_attention_forward then takes is_causal over the whole gathered row. So on SDPA (the only
attention ArcticTraining's SP runs on a CPU: flash-attention is CUDA-only) a packed row attends across its samples.

This script shows it on 2 Gloo ranks with a tiny random Llama in fp64 (DeepSpeed 0.19.8 and transformers 5.23.0, the
venv of the survey's arctic-sft-* entries; ArcticTraining itself pins transformers < 5, whose SDPA forward has the
same rule), ArcticTraining's two SP lines re-stated (its register_with_transformers call and its SDPA mask
function), one row of two packed samples of 10 and 14 tokens split 12/12 over the ranks. Each rank's loss is its
tokens' CE sum over the row's target count (the convention DeepSpeed's SP reduction expects); the ranks' gradients
are summed. Judged against one process with no SP:
  - oracle: each sample alone (what packing means);
  - leak: the packed row with restarting positions and a plain causal mask over the whole row;
  - the same packed run without ArcticTraining's SDPA mask function (DeepSpeed's wrapper alone) against the leak;
  - control: an unpacked row of 24 tokens under the same SP run, against one process (the SP machinery is exact).
Prints one JSON line and exits 0 when the packed SP gradient misses the oracle and equals the leak (to 1e-10).
Usage: ~/.cache/streambp/venv-torch-2.14.1/bin/python experiments/survey/repro/alst_packed_sp_sdpa.py
"""
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
LENGTHS = (10, 14)  # one packed row; the second sample straddles the ranks' 12/12 split
SP = 2


def normwise(grads, reference):
    import torch

    num = sum(float((grads[n] - reference[n]).double().pow(2).sum()) for n in reference)
    den = sum(float(reference[n].double().pow(2).sum()) for n in reference)
    worst = max(reference, key=lambda n: float((grads[n] - reference[n]).norm() / reference[n].norm().clamp_min(1e-300)))
    return (num / den) ** 0.5, worst


def worker(out_path):
    import torch
    import torch.nn.functional as F
    import transformers

    sys.path.insert(0, str(HERE.parents[3] / "verify" / "conform" / "survey"))
    import deepspeed_common  # init_distributed_gloo: deepspeed.init_distributed without its shared-memory op's JIT
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    deepspeed_common.init_distributed_gloo()
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="sdpa", use_cache=False, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).to(torch.float64)
    T = sum(LENGTHS)
    ids = torch.randint(1, config.vocab_size, (1, T))
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    packed_pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    labels = ids.clone()
    labels[0, starts] = -100  # each sample's first label: nothing before it in its sample predicts it
    shift = torch.cat([labels[:, 1:], torch.full((1, 1), -100)], dim=1)  # shifted over the row, as Ulysses does
    N = int((shift != -100).sum())

    def grads_of(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    def ce_sum(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")

    # one process, before Ulysses is registered
    oracle = grads_of(sum(ce_sum(model(input_ids=ids[:, s:s + n], position_ids=packed_pos[:, s:s + n]).logits,
                                 shift[:, s:s + n]) for s, n in zip(starts, LENGTHS)) / N)
    causal = torch.zeros(1, 1, T, T, dtype=torch.float64).masked_fill(
        ~torch.ones(T, T, dtype=torch.bool).tril(), torch.finfo(torch.float64).min)
    leak = grads_of(ce_sum(model(input_ids=ids, position_ids=packed_pos, attention_mask=causal).logits, shift) / N)
    plain_pos = torch.arange(T)[None]
    plain = grads_of(ce_sum(model(input_ids=ids, position_ids=plain_pos).logits, shift) / N)

    # ArcticTraining's SP setup, re-stated (trainer/trainer.py lines 191-198 and 225-231)
    UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=SP, micro_batch_size=1,
        seq_length=T, seq_length_is_variable=True)
    c = T // SP
    mine = slice(c * rank, c * (rank + 1))

    def sp_grads(pos):
        out = grads_of(ce_sum(model(input_ids=ids[:, mine], position_ids=pos[:, mine]).logits, shift[:, mine]) / N)
        for g in out.values():
            dist.all_reduce(g)  # the sequence ranks' shares summed, as ZeRO's reduction does
        return out

    # first DeepSpeed's wrapper alone (transformers builds each shard's packed mask from its position_ids, which the
    # wrapper drops), then with ArcticTraining's SDPA mask function (no mask is built at all)
    packed_ds = sp_grads(packed_pos)
    import transformers.masking_utils

    transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa", lambda *args, **kwargs: None)
    packed_sp = sp_grads(packed_pos)
    plain_sp = sp_grads(plain_pos)
    if rank == 0:
        result = {}
        for key, got, ref in (("packed_sp_vs_oracle", packed_sp, oracle), ("packed_sp_vs_leak", packed_sp, leak),
                              ("packed_sp_deepspeed_alone_vs_leak", packed_ds, leak),
                              ("unpacked_sp_vs_one_process", plain_sp, plain)):
            err, worst = normwise(got, ref)
            result[key] = {"normwise": err, "worst_tensor": worst}
        Path(out_path).write_text(json.dumps(result))
    dist.barrier()
    return 0


def main():
    sys.path.insert(0, str(HERE.parent))
    import pins  # noqa: F401  (puts experiments/survey on the path)
    import survey

    entries = json.loads((HERE.parents[1] / "implementations.json").read_text())
    entry = next(e for e in entries if e["name"] == "arctic-sft-zero2")  # the same venv, made the same way
    python = survey.venv_python(entry)
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"alst_packed_sp_sdpa-{os.getpid()}.json"
    port = str(29500 + os.getpid() % 2000)
    done = subprocess.run([python, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(SP),
                           "--master_addr", "127.0.0.1", "--master_port", port, str(HERE), "--worker", str(out)],
                          env=dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
                                   OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if done.returncode != 0:
        print("\n".join(done.stderr.strip().splitlines()[-15:]), file=sys.stderr)
        return 1
    result = json.loads(out.read_text())
    out.unlink()
    shown = ok = (result["packed_sp_vs_oracle"]["normwise"] > 1e-6 and result["packed_sp_vs_leak"]["normwise"] < 1e-10
                  and result["packed_sp_deepspeed_alone_vs_leak"]["normwise"] < 1e-10
                  and result["unpacked_sp_vs_one_process"]["normwise"] < 1e-10)
    result["verdict"] = "packed samples attend across each other under SP on SDPA" if shown else "not shown"
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2]))
    sys.exit(main())
