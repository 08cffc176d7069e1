#!/usr/bin/env python3
"""DeepSpeed ALST with Ulysses sequence parallelism (SP=2) on CPU over Gloo: UlyssesSPAttentionHF registered with HF
(register_with_transformers, core attention "sdpa"), TiledMLP on every decoder MLP, TiledFusedLogitsLoss (global
normaliser, as deepspeed_tiled.py's default) on each rank's sequence shard. Usage: deepspeed_ulysses.py CASE_DIR

The adapter re-launches itself under torchrun (2 processes, Gloo on 127.0.0.1). Each rank gets the sequence shard
[r*T/2, (r+1)*T/2) of input_ids, position_ids and the pre-shifted labels, as UlyssesSPDataLoaderAdapter.refill shards
one micro-batch (done here directly: one batch, not the adapter's one-sample-per-rank SP-over-DP rotation). T is
right-padded to a multiple of 2 (pad id 0, label -100): Ulysses drops the attention mask and relies on causal sdpa,
and causal attention never lets a valid token see a later pad, so right padding changes no valid token. Each rank's
loss is (its targets' CE sum) / N_global; the full loss and gradient are the sums over ranks (all_reduce SUM of the
replicated parameters' gradients). Rank 0 writes the outputs.
DS_SP: the SP degree for a case with "ranks" 1 (default 2). DS_ULYSSES_OFF=1: the negative control (no Ulysses: each
rank's attention sees only its own shard).
"""
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))  # verify/conform: the streambp_conform package (no torch at import)
from streambp_conform.protocol import declines_rl_step  # noqa: E402
SP = int(os.environ.get("DS_SP", "2"))


def launch(case_dir):
    if (declined := declines_rl_step(case_dir)) is not None:  # before torchrun, which reports a rank's 3 as 1
        return declined
    import json

    global SP
    meta = json.loads((Path(case_dir) / "case.json").read_text())
    if meta.get("micro_batches"):  # said before torchrun, which reports a rank's exit 3 as 1
        print(f"{Path(case_dir).name}: {len(meta['micro_batches'])} micro-batches: this adapter runs one batch per "
              "optimizer step", file=sys.stderr)
        return 3  # protocol.NOT_EXPRESSIBLE
    ranks = int(meta.get("ranks", 1))
    if ranks > 1:
        SP = ranks  # the case's processes: Ulysses over all of them
    # Ulysses' own refusal (UlyssesSPAttentionHF.__init__), said before torchrun, which reports a rank's exit 3 as 1
    config = json.loads((Path(case_dir) / "model" / "config.json").read_text())
    heads = (config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"]))
    if heads[0] % SP or (heads[1] % SP and SP % heads[1]):
        print(f"{Path(case_dir).name}: {heads[0]} query / {heads[1]} KV heads on {SP} ranks: Ulysses splits heads",
              file=sys.stderr)
        return 3  # protocol.NOT_EXPRESSIBLE
    os.environ["DS_SP"] = str(SP)
    port = str(29500 + os.getpid() % 2000)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(SP),
           "--master_addr", "127.0.0.1", "--master_port", port, str(HERE), "--worker", case_dir]
    return subprocess.call(cmd, env=dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo")))


def worker(case_dir):
    import math

    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(HERE.parent))
    import deepspeed_common as ds_common
    from deepspeed_common import protocol

    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP, UlyssesSPAttentionHF
    from transformers.loss.loss_utils import fixed_cross_entropy

    ds_common.init_distributed_gloo()
    rank = dist.get_rank()
    try:
        case = protocol.read_case(case_dir, packs=False)  # packed rows: not declared
        ds_common.configure(case)
        if case.objective["name"] != "sft":
            ds_common.not_expressible(f"{case.objective['name']}: this Ulysses adapter runs SFT only")
        ds_common.patch_mlps_with_tiled_mlp(TiledMLP)
        model, trainable = protocol.load_model(case)
        B, T = case.batch["input_ids"].shape
        if os.environ.get("DS_ULYSSES_OFF"):  # negative control: shards attend only within themselves
            import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
            mpu.initialize_sequence_parallel(sequence_parallel_size=SP)
        else:
            mpu = UlyssesSPAttentionHF.register_with_transformers(
                model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=SP,
                micro_batch_size=B, seq_length_is_variable=True)
        group = mpu.get_sequence_parallel_group()
        sp_rank = mpu.get_sequence_parallel_rank()
    except Exception as e:  # CaseError -> 2, NotExpressible -> 3, the rest a crash
        if rank == 0:
            print(f"{Path(case_dir).name}: {type(e).__name__}: {e}", file=sys.stderr)
        if isinstance(e, protocol.NotExpressible):
            return protocol.NOT_EXPRESSIBLE
        if isinstance(e, protocol.CaseError):
            return 2
        raise

    b = case.batch
    Tp = math.ceil(T / SP) * SP
    pad = Tp - T
    input_ids = F.pad(b["input_ids"], (0, pad), value=0)
    shift_labels = ds_common.shift(F.pad(b["labels"], (0, pad), value=-100))
    position_ids = torch.arange(Tp).unsqueeze(0).expand(B, Tp).contiguous()
    n_global = (shift_labels != -100).sum()
    c = Tp // SP
    sl = slice(c * sp_rank, c * (sp_rank + 1))
    ids_l, pos_l, lab_l = input_ids[:, sl], position_ids[:, sl], shift_labels[:, sl]
    lm = ds_common.causal_lm_of(model, case)
    up = ds_common.loss_dtype(case.dtype)
    vocab = lm.config.vocab_size

    def loss_fn(model, case):
        hidden = lm.model(input_ids=ids_l, position_ids=pos_l).last_hidden_state  # no attention_mask under Ulysses

        def fn(self, x, y):
            return fixed_cross_entropy(self.lm_head(x).to(up).view(-1, vocab), y.view(-1), num_items_in_batch=n_global)

        shards = max(1, math.ceil(lab_l.numel() / case.head_chunk))
        return TiledFusedLogitsLoss.apply(fn, lm, hidden, lab_l, None, shards, [lm.lm_head.weight], "sum")

    loss_local, grads, seconds = protocol.run_step(case, model, trainable, loss_fn)
    for g in grads.values():
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=group)
    total = torch.tensor([loss_local], dtype=torch.float64)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    if rank == 0:
        protocol.write_outputs(case, total.item(), grads, seconds)
    dist.barrier()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2]))
    if len(sys.argv) != 2:
        print("Usage: deepspeed_ulysses.py CASE_DIR", file=sys.stderr)
        sys.exit(2)
    sys.exit(launch(sys.argv[1]))
