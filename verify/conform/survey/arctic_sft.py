#!/usr/bin/env python3
"""ArcticTraining's SFT loss path at sequence parallelism > 1 (arctic-training 0.8.0, `SFTTrainer.loss` in
arctic_training/trainer/sft_trainer.py) over DeepSpeed 0.19.8's engine, on Gloo ranks. Usage:
arctic_sft.py [--zero=2|3] [--accum=1|2] [--loss=arctic|share] CASE_DIR

ArcticTraining takes DeepSpeed's TiledFusedLogitsLoss only when sequence_parallel_size > 1 and the model is not Liger
(sft_trainer.py lines 48-54: at SP = 1 the model's own loss; lines 84-95: Liger's fused loss). This adapter runs
that path, re-stated (nothing imported from arctic-training: it pins transformers < 5), on SP = the case's ranks
(2 for a one-rank case) Gloo processes:
  - the sequence split as UlyssesSPDataLoaderAdapter does: labels shifted over the whole row first (shift_labels),
    then rank r takes [r T/W, (r+1) T/W) of input_ids, position_ids and shift_labels (T right-padded to W's multiple:
    Ulysses drops the attention mask and relies on causal sdpa, so a pad never reaches a valid token);
  - the rank's loss as lines 116-152: TiledFusedLogitsLoss over the rank's hidden states with fn = the tile's mean
    CE x its target count (0 x logits.sum() for a tile without targets), output_reduction "sum", the output divided
    by the rank's target count;
  - the ranks' losses aggregated as lines 154-160: torch.distributed.nn.functional.all_gather of the losses and the
    target counts, their target-weighted mean;
  - DeepSpeed's engine (deepspeed.initialize with Ulysses' mpu, ZeRO stage --zero, gradient_accumulation_steps
    --accum, a client SGD at lr 0): engine.backward(loss) per micro-batch (the batch's rows split into --accum
    consecutive parts, a short one padded with rows without targets: Ulysses wants a fixed micro-batch size),
    engine.step() between micro-batches, and after the last backward, before the step, the reduced gradient the
    optimizer would take: deepspeed.utils.safe_get_full_grad, written by rank 0.
--loss=share is the control with DeepSpeed alone: no TiledFusedLogitsLoss and no all_gather, each rank back-propagates
its tokens' CE sum over the micro-batch's target count, the share DeepSpeed's ZeRO reduction expects (it sums the
sequence ranks' gradients and divides by the data-parallel size only: stage_1_and_2.py line 1688, stage3.py 1878).
The loss written is the micro-batches' losses weighted by their target counts (the step's token mean).
CE in the case dtype upcast to at least fp32 (HF's loss_function would round fp64 logits to fp32).
A packed case (issue #59): each rank's shard of the case's position_ids, restarting at 0 per sequence as ArcticTraining's
pack_samples writes them (data/sft_factory.py pack_sft_batch), in place of the row's global positions, and no mask
(its collator passes none); the attention is DeepSpeed's UlyssesSPAttentionHF on SDPA, as for every case.
"""
import math
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))  # verify/conform: the streambp_conform package (no torch at import)
from streambp_conform.protocol import declines_rl_step  # noqa: E402
FLAGS = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--") and "=" in a}
ZERO = int(FLAGS.get("--zero", "2"))
ACCUM = int(FLAGS.get("--accum", "1"))
LOSS = FLAGS.get("--loss", "arctic")  # share: DeepSpeed alone, no ArcticTraining (each rank its CE sum / G)


def launch(case_dir):
    if (declined := declines_rl_step(case_dir)) is not None:  # before torchrun, which reports a rank's 3 as 1
        return declined
    import json

    meta = json.loads((Path(case_dir) / "case.json").read_text())
    name = (meta.get("objective") or {}).get("name")
    if name != "sft" or meta.get("lora") or meta.get("micro_batches"):  # before torchrun (it turns exit 3 into 1)
        why = f"{name}: ArcticTraining's SFT trainer" if name != "sft" else \
            "LoRA: the survey runs ArcticTraining's full fine-tuning" if meta.get("lora") else \
            f"{len(meta['micro_batches'])} micro-batches: the entry's steps are its --accum split of one batch"
        print(f"{Path(case_dir).name}: {why}", file=sys.stderr)
        return 3
    ranks = int(meta.get("ranks", 1))
    sp = ranks if ranks > 1 else 2  # ArcticTraining takes this path only at SP > 1
    port = str(29500 + os.getpid() % 2000)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(sp),
           "--master_addr", "127.0.0.1", "--master_port", port, str(HERE), f"--zero={ZERO}", f"--accum={ACCUM}", f"--loss={LOSS}",
           "--worker", case_dir]
    done = subprocess.run(cmd, env=dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo")),
                          capture_output=True, text=True)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    if done.returncode != 0:  # the last line is conform's cause: a rank's exception, not torchrun's banner
        errors = re.findall(r"^\[rank(\d+)\]: (\w+(?:Error|Exception)\b.*)$", done.stderr, re.M)
        if errors:
            print(f"{Path(case_dir).name}: rank {errors[-1][0]}: {errors[-1][1]}", file=sys.stderr)
    return done.returncode


def worker(case_dir):
    import torch
    import torch.distributed.nn.functional as dist_nn
    import torch.nn.functional as F

    sys.path.insert(0, str(HERE.parent))
    import deepspeed_common as ds_common
    from deepspeed_common import protocol

    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, UlyssesSPAttentionHF
    from deepspeed.utils import safe_get_full_grad
    from transformers.loss.loss_utils import fixed_cross_entropy

    ds_common.init_distributed_gloo()
    rank, sp = dist.get_rank(), dist.get_world_size()
    try:
        case = protocol.read_case(case_dir, packs=True)  # packed rows: position_ids restarting per sequence
        B, T = case.batch["input_ids"].shape
        if ACCUM > B:
            raise protocol.CaseError(f"--accum={ACCUM} micro-batches for {B} rows")
        model, trainable = protocol.load_model(case)
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp,
            micro_batch_size=math.ceil(B / ACCUM), seq_length_is_variable=True)
        config = {"train_micro_batch_size_per_gpu": math.ceil(B / ACCUM), "gradient_accumulation_steps": ACCUM,
                  "zero_optimization": {"stage": ZERO}, "zero_allow_untested_optimizer": True,
                  "gradient_clipping": 0.0, "steps_per_print": 10**9}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
    except (protocol.NotExpressible, protocol.CaseError) as e:
        if rank == 0:
            print(f"{Path(case_dir).name}: {e}", file=sys.stderr)
        return protocol.NOT_EXPRESSIBLE if isinstance(e, protocol.NotExpressible) else 2

    lm = engine.module
    up = ds_common.loss_dtype(case.dtype)
    vocab = lm.config.vocab_size
    group = mpu.get_sequence_parallel_group()

    def fn(self, x, y):  # one tile of the rank's flattened tokens: x [n, H], y [n]
        logits = self.lm_head(x).to(up)
        if bool((y == -100).all()):
            return logits.sum() * 0.0
        return fixed_cross_entropy(logits.view(-1, vocab), y.view(-1)) * (y != -100).sum()

    b = case.batch
    Tp = math.ceil(T / sp) * sp
    input_ids = F.pad(b["input_ids"], (0, Tp - T), value=0)
    shift_labels = ds_common.shift(F.pad(b["labels"], (0, Tp - T), value=-100))  # [B, Tp]
    c = Tp // sp
    mine = slice(c * rank, c * (rank + 1))
    loss_sum, targets = 0.0, 0
    rows_per_micro = math.ceil(B / ACCUM)
    for rows in torch.arange(B).tensor_split(ACCUM):
        # Ulysses wants every micro-batch of micro_batch_size rows: a short one gets rows without targets (pad id 0,
        # labels -100), which change no loss and no gradient
        extra = rows_per_micro - len(rows)
        ids = F.pad(input_ids[rows], (0, 0, 0, extra), value=0)[:, mine]
        labels = F.pad(shift_labels[rows], (0, 0, 0, extra), value=-100)[:, mine]
        if case.packed:  # as pack_sft_batch writes them, restarting per sample; a short micro-batch's extra rows 0..
            pos = F.pad(F.pad(case.position_ids, (0, Tp - T), value=0)[rows], (0, 0, 0, extra), value=0)[:, mine]
        else:
            pos = torch.arange(c * rank, c * (rank + 1)).expand(rows_per_micro, c).contiguous()
        hidden = lm.model(input_ids=ids, position_ids=pos).last_hidden_state  # [b, c, H]
        if LOSS == "share":  # the convention DeepSpeed's SP reduction expects: the rank's share of the mean
            n = (shift_labels[rows] != -100).sum()  # the micro-batch's targets over all ranks
            loss = F.cross_entropy(lm.lm_head(hidden).to(up).flatten(0, 1), labels.flatten(), ignore_index=-100,
                                   reduction="sum") / n
            engine.backward(loss)
            part = loss.detach().clone()
            dist.all_reduce(part, group=group)
            loss_sum, targets = loss_sum + part.item() * int(n), targets + int(n)
            if not engine.is_gradient_accumulation_boundary():
                engine.step()
            continue
        shards = max(1, math.ceil(labels.numel() / case.head_chunk))
        total = TiledFusedLogitsLoss.apply(fn, lm, hidden, labels, None, shards, [lm.lm_head.weight], "sum")
        good = (labels != -100).sum()
        loss = total / max(good, 1)
        losses = dist_nn.all_gather(loss, group=group)
        goods = dist_nn.all_gather(good, group=group)
        loss = sum(l * g for l, g in zip(losses, goods)) / sum(goods)
        engine.backward(loss)
        n = int(sum(goods))
        loss_sum, targets = loss_sum + loss.item() * n, targets + n
        if not engine.is_gradient_accumulation_boundary():
            engine.step()  # DeepSpeed counts the micro-batch; the boundary's step comes after the read below
    grads = {name: safe_get_full_grad(p) for name, p in trainable.items()}  # every rank: ZeRO-3 gathers
    if rank == 0:
        missing = [n for n, g in grads.items() if g is None]
        if missing:
            print(f"{Path(case_dir).name}: no reduced gradient for {missing[:4]}", file=sys.stderr)
            return 2
        protocol.write_outputs(case, loss_sum / targets, {n: g.to(case.dtype).contiguous() for n, g in grads.items()})
    dist.barrier()
    return 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not (a.startswith("--") and "=" in a)]
    if len(args) == 2 and args[0] == "--worker":
        sys.exit(worker(args[1]))
    if len(args) != 1 or args[0].startswith("-"):
        print("Usage: arctic_sft.py [--zero=2|3] [--accum=1|2] [--loss=arctic|share] CASE_DIR", file=sys.stderr)
        sys.exit(2)
    sys.exit(launch(args[0]))
