#!/usr/bin/env python3
"""ms-swift's sequence-parallel SFT loss path on Gloo ranks on the CPU, called as its Seq2SeqTrainer calls it
(swift/trainers/seq2seq_trainer.py: _prepare_inputs, compute_loss; swift/sequence_parallel/sequence_parallel.py).
Usage: ms_swift_sp.py [--loss-type cross_entropy] CASE_DIR

Per rank, with ms-swift's own objects: sequence_parallel.prepare(W, model, tokenizer, padding_free=False) (its device
mesh, its Ulysses all-to-all around HF's SDPA, the forward pre-hook that pads and splits input_ids and position_ids),
sequence_parallel.prepare_inputs (labels rolled by one, padded and split), the forward, per_token_loss_func_sp (the
shard's per-token CE, then GatherLoss, whose backward scales by W), and then either its default reduction
(outputs.loss.sum() / num_items_in_batch) or, with --loss-type cross_entropy, the loss object `swift sft --loss_type
cross_entropy` builds (swift.loss.mapping: CustomCrossEntropyLoss(args, trainer), called as compute_loss_func).
What the adapter re-states from transformers' Trainer around it (not run): num_items_in_batch = the step's
labels[..., 1:] targets gathered over the W ranks (average_tokens_across_devices, its default; every SP rank holds
the same batch), the loss then x W (compute_loss, as ms-swift's trainer sets model_accepts_loss_kwargs), backward per
micro-batch, and DDP's mean of the gradients over the W ranks. A row's first label is set to -100: ms-swift's roll
wraps it to the row's last position, and its templates never make it a target (HF's loss ignores it too).
The case's ranks (default 2 for a one-rank case) are the SP degree, dp = 1; SDPA (ms-swift's CPU attention; its ring
attention needs flash-attention and padding_free).
"""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))  # verify/conform: the streambp_conform package (no torch at import)
from streambp_conform.protocol import declines_rl_step  # noqa: E402


def launch(case_dir, flags):
    if (declined := declines_rl_step(case_dir)) is not None:  # before torchrun, which reports a rank's 3 as 1
        return declined
    meta = json.loads((Path(case_dir) / "case.json").read_text())
    if meta.get("lora"):  # said before any process starts (torchrun would report a rank's 3 as 1)
        print(f"{Path(case_dir).name}: LoRA: not wired (ms-swift's tuners wrap the model before SP)", file=sys.stderr)
        return 3  # protocol.NOT_EXPRESSIBLE
    ranks = int(meta.get("ranks", 1))
    sp = ranks if ranks > 1 else 2
    config = json.loads((Path(case_dir) / "model" / "config.json").read_text())
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    if kv_heads % sp:  # ms-swift would take gcd(kv heads, W) for Ulysses and the rest as ring attention
        print(f"{Path(case_dir).name}: {kv_heads} KV heads on {sp} ranks: ms-swift's ring attention (the rest of "
              "gcd) needs flash-attention and padding_free", file=sys.stderr)
        return 3  # protocol.NOT_EXPRESSIBLE
    port = str(29500 + os.getpid() % 2000)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(sp),
           "--master_addr", "127.0.0.1", "--master_port", port, str(HERE), "--worker", *flags, case_dir]
    return subprocess.call(cmd, env=dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo")))


def worker(case_dir, flags):
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE.parents[1]))
    import protocol

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        case = protocol.read_case(case_dir, accumulates=True, distributed=True, packs=False)
        if case.objective["name"] != "sft":
            raise protocol.NotExpressible(f"{case.objective['name']}: this adapter runs ms-swift's SFT loss only")
        model, trainable = protocol.load_model(case)
    except Exception as e:  # CaseError -> 2, NotExpressible -> 3, the rest a crash
        if rank == 0:
            print(f"{Path(case_dir).name}: {type(e).__name__}: {e}", file=sys.stderr)
        if isinstance(e, protocol.NotExpressible):
            return protocol.NOT_EXPRESSIBLE
        if isinstance(e, protocol.CaseError):
            return 2
        raise

    from swift.sequence_parallel import sequence_parallel
    from swift.trainers.utils import per_token_loss_func_sp

    # what ms-swift's get_model_tokenizer attaches to a text-only, dense model
    model.model_meta = SimpleNamespace(model_arch=None)
    model.model_info = SimpleNamespace(is_moe_model=False)
    model.set_attn_implementation("sdpa")
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    sequence_parallel.prepare(world, model, SimpleNamespace(pad_token_id=pad_id), padding_free=False)
    loss_fn = None
    if "--loss-type" in flags:
        from swift.loss.mapping import loss_map
        trainer = SimpleNamespace(template=SimpleNamespace(sequence_parallel_size=world),
                                  args=SimpleNamespace(average_tokens_across_devices=True),
                                  model_accepts_loss_kwargs=True, model=model,
                                  accelerator=SimpleNamespace(num_processes=world))
        loss_fn = loss_map[flags[flags.index("--loss-type") + 1]](trainer.args, trainer)

    b = case.batch
    labels_all = b["labels"].clone()
    labels_all[:, 0] = -100
    # the Trainer's num_items_in_batch: the step's shifted targets, summed over the world (each rank's copy)
    num_items = (labels_all[:, 1:] != -100).sum() * world

    def micro_loss(rows):
        rows = torch.tensor(rows)
        mask = b["attention_mask"][rows] if "attention_mask" in b else torch.ones_like(b["input_ids"][rows])
        inputs = {"input_ids": b["input_ids"][rows], "attention_mask": mask,
                  "position_ids": (mask.cumsum(-1) - 1).clamp(min=0), "labels": labels_all[rows]}
        sequence_parallel.prepare_inputs(inputs)  # Seq2SeqTrainer._prepare_inputs
        labels = inputs.pop("labels")  # compute_loss: SP > 1 pops the labels
        outputs = model(**inputs, use_cache=False)
        outputs.loss = per_token_loss_func_sp(outputs, labels)
        if loss_fn is not None:
            loss = loss_fn(outputs, labels, num_items_in_batch=num_items, loss_scale=None)
        else:
            loss = outputs.loss.sum() / num_items
        return loss * world  # average_tokens_across_devices with model_accepts_loss_kwargs

    for p in trainable.values():
        p.grad = None
    loss = 0.0
    for rows in case.micro_batches or [list(range(b["input_ids"].shape[0]))]:
        part = micro_loss(rows)
        part.backward()
        loss += part.item()
    grads = {n: p.grad.detach().contiguous() for n, p in trainable.items()}
    for g in grads.values():  # DDP's mean over the W ranks (dp x sp)
        dist.all_reduce(g, op=dist.ReduceOp.SUM)
        g.div_(world)
    if rank == 0:  # rank 0's loss, as the Trainer logs
        steps = len(case.micro_batches) if case.micro_batches else None
        protocol.write_outputs(case, loss, grads, micro_batches=steps)
    dist.barrier()
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--worker":
        sys.exit(worker(args[-1], args[1:-1]))
    if len(args) not in (1, 3) or (len(args) == 3 and args[0] != "--loss-type"):
        print("Usage: ms_swift_sp.py [--loss-type cross_entropy] CASE_DIR", file=sys.stderr)
        sys.exit(2)
    sys.exit(launch(args[-1], args[:-1]))
