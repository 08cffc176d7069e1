#!/usr/bin/env python3
"""HF Transformers under a sequence split on the case's Gloo ranks (case.json "parallel": "sequence", issue #45): the
reference adapter of the sequence-parallel cases, judged like every case against one process's gradients.

Rank r of W owns positions [r T / W, (r + 1) T / W) of every row (balanced: T need not divide by W) with their
labels, shifted over the whole sequence before the split. Its positions' attention needs the whole causal prefix,
made available the simplest exact way: the rank recomputes the decoder over [0, end_r) (a causal position sees no
later one) instead of exchanging K/V; the lm_head and the loss run on its own positions only. The loss is aggregated
as a split must: each rank's token-loss sum over the GLOBAL target count (an all-reduce of the ranks' own counts),
the gradients all-reduced with SUM, so rank 0 holds what its optimizer would see, the whole batch's gradient.
SequenceSplit is the split and aggregation; tests/support/conform_sp_faulty_adapter.py replaces one piece at a time.

The launcher supervises the ranks: one that raises or dies ends the run with a line naming it (the others stopped);
at conform's --timeout (SIGTERM) it names each rank that had not finished and what it was doing.
SFT (full or LoRA), any dtype; other objectives and data-parallel cases are not expressible (exit status 3).
Usage: hf_sp_adapter.py CASE_DIR
"""
import importlib
import json
import os
import signal
import sys
import tempfile
import time
from multiprocessing.connection import wait
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the streambp_conform package beside this file (no torch at import)
from streambp_conform.protocol import declines_rl_step  # noqa: E402

# What a rank is doing, by index (a shared array holds each rank's): named when the run is stopped.
PHASES = ("starting", "loading the model", "in the target count's all-reduce", "computing its shard's loss and "
          "gradients", "in the gradients' all-reduce", "writing the outputs", "done")
LOADING, COUNTING, COMPUTING, REDUCING, WRITING, DONE = range(1, 7)


class SequenceSplit:
    """How the ranks split a sequence and aggregate the loss: what a sequence-parallel library decides."""

    def shard(self, T, rank, world):
        """The positions rank `rank` owns: balanced, the first T mod W ranks one more."""
        return slice(rank * T // world, (rank + 1) * T // world)

    def rank_loss(self, token_sum, own_count, global_count):
        """The loss a rank back-propagates: its share of the batch's mean (the sum over ranks is the mean)."""
        return token_sum / global_count

    def reduce(self, dist, grad, world):
        """Rank 0's gradient from the ranks' shares: their sum."""
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)


def rank_main(rank, world, case, rendezvous, split, phase, errors):
    """One rank, forked from the launcher (its imports done once, not once per rank)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's handler is the launcher's
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import protocol

    try:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
        phase[rank] = LOADING
        model, trainable = protocol.load_model(case)
        causal = model.get_base_model() if case.lora else model  # PEFT's layers live inside the base modules
        b = case.batch
        if "labels" not in b:
            raise protocol.CaseError("sft: batch.safetensors has no 'labels'")
        targets = F.pad(b["labels"], (0, 1), value=-100)[:, 1:]  # [B, T]: position t predicts token t + 1
        phase[rank] = COMPUTING
        start = time.perf_counter()
        mine = split.shard(targets.size(1), rank, world)
        own_targets = targets[:, mine]  # [B, t]
        own_count = (own_targets != -100).sum()
        global_count = own_count.clone()
        phase[rank] = COUNTING
        dist.all_reduce(global_count)  # each rank knows only its shard's labels
        phase[rank] = COMPUTING
        end = mine.stop
        hidden = causal.model(input_ids=b["input_ids"][:, :end],
                              attention_mask=b["attention_mask"][:, :end]).last_hidden_state  # [B, end, d]
        logits = causal.lm_head(hidden[:, mine])  # [B, t, V]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # HF's loss upcast, fp64 kept
        token_sum = F.cross_entropy(logits.flatten(0, 1), own_targets.flatten(), ignore_index=-100, reduction="sum")
        loss = split.rank_loss(token_sum, own_count, global_count)
        loss.backward()
        phase[rank] = REDUCING
        missing = [n for n, p in trainable.items() if p.grad is None]
        if missing:
            raise protocol.CaseError(f"no gradient for {missing[:4]}")
        grads = {n: p.grad.detach().clone() for n, p in trainable.items()}
        for g in grads.values():
            split.reduce(dist, g, world)
        total = loss.detach().clone()
        split.reduce(dist, total, world)
        seconds = time.perf_counter() - start
        phase[rank] = WRITING
        if rank == 0:
            grads = {n: g.to(case.dtype).contiguous() for n, g in grads.items()}
            protocol.write_outputs(case, total.item(), grads, seconds)
        dist.barrier()
        phase[rank] = DONE
    except Exception as e:
        errors.put((rank, PHASES[phase[rank]], f"{type(e).__name__}: {e}".strip().splitlines()[-1]))
        sys.exit(2 if isinstance(e, protocol.CaseError) else 1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def death(process):
    """How a rank's process ended: an exit status or a signal's name."""
    code = process.exitcode
    return f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"


def supervise(processes, phase, errors):
    """Waits for the ranks; at the first that fails, the others are stopped and the failures named, a rank outside a
    collective first (the cause; a rank waiting in one fails with it). Returns the adapter's exit status."""
    pending = dict(enumerate(processes))
    failed = []
    while pending and not failed:
        for sentinel in wait([p.sentinel for p in pending.values()]):
            rank = next(r for r, p in pending.items() if p.sentinel == sentinel)
            pending.pop(rank).join()
            if processes[rank].exitcode != 0:
                failed.append(rank)
    if not failed:
        return 0
    time.sleep(0.5)  # let the ranks the failure breaks report, so that the cause is told apart from them
    for rank, process in pending.items():
        if process.exitcode not in (None, 0):
            failed.append(rank)
        process.kill()
    reports = {}
    while not errors.empty():
        rank, at, message = errors.get()
        reports[rank] = (at, message)
    collective = (PHASES[COUNTING], PHASES[REDUCING])
    failed.sort(key=lambda r: (reports.get(r, (PHASES[phase[r]],))[0] in collective, r))
    told = []
    for rank in failed:
        if rank in reports:
            told.append(f"rank {rank} failed while {reports[rank][0]}: {reports[rank][1]}")
        else:  # no word from it: killed, or gone without Python's help
            told.append(f"rank {rank} died ({death(processes[rank])}) while {PHASES[phase[rank]]}")
    print("; then ".join(told) + ("; the other ranks were stopped" if len(failed) < len(processes) else ""),
          file=sys.stderr)
    return 2 if processes[failed[0]].exitcode == 2 else 1


def main(argv, split=None):
    if len(argv) != 1 or argv[0].startswith("-"):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    case_dir = Path(argv[0])
    if (declined := declines_rl_step(case_dir)) is not None:  # before its own reading says "parallel"
        return declined
    try:  # decline before importing torch: a data-parallel case costs no start-up
        meta = json.loads((case_dir / "case.json").read_text())
    except (OSError, ValueError) as e:
        print(f"{case_dir.name}: case.json: {e}", file=sys.stderr)
        return 2
    reason = None
    if meta.get("parallel", "data") != "sequence":
        reason = f"parallel {meta.get('parallel', 'data')!r} on {meta.get('ranks', 1)} rank(s): this adapter splits " \
                 "the sequence over ranks"
    elif (meta.get("objective") or {}).get("name") != "sft":
        reason = f"objective {(meta.get('objective') or {}).get('name')}: this adapter splits SFT's loss only"
    elif meta.get("packed"):  # its ranks recompute a causal prefix by attention_mask: a sequence's start is not kept
        reason = "packed rows: this adapter's ranks recompute each shard's causal prefix of the whole row, with no " \
                 "sequence boundaries (streambp train --sp runs packed rows across ranks)"
    if reason:
        print(f"{case_dir.name}: {reason}", file=sys.stderr)
        return 3  # protocol.NOT_EXPRESSIBLE
    import multiprocessing as mp

    import torch

    sys.path.insert(0, str(HERE))
    import protocol

    torch.set_num_threads(1)  # the ranks share the machine's cores (and no OpenMP pool exists to fork)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # as hf_ddp_adapter.py: the loopback, not the host's address
    try:
        case = protocol.read_case(case_dir)
        protocol.quiet_hf()
        model_type = json.loads((case.dir / "model" / "config.json").read_text()).get("model_type", "")
        # The model's classes imported once, before the fork, not once per rank (seconds each)
        importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        if case.lora:
            import peft  # noqa: F401
    except (protocol.CaseError, OSError, ValueError, ImportError) as e:
        print(f"{case_dir.name}: {e}", file=sys.stderr)
        return 2
    world = case.ranks
    fd, rendezvous = tempfile.mkstemp(prefix=".sp-rendezvous-", dir=case_dir)
    os.close(fd)
    os.remove(rendezvous)  # init_method file:// wants a path that does not exist yet
    ctx = mp.get_context("fork")
    phase = ctx.Array("i", world, lock=False)  # one writer per entry
    errors = ctx.Queue()
    processes = [ctx.Process(target=rank_main, args=(r, world, case, rendezvous, split or SequenceSplit(), phase,
                                                     errors)) for r in range(world)]

    def on_term(signum, frame):  # conform's --timeout: name what each unfinished rank was doing, then go
        stuck = [f"rank {r} {PHASES[phase[r]]}" for r, p in enumerate(processes) if phase[r] != DONE]
        print(f"stopped (SIGTERM) before every rank finished: {', '.join(stuck)}", file=sys.stderr, flush=True)
        for p in processes:
            if p.is_alive():
                p.kill()
        os._exit(1)

    signal.signal(signal.SIGTERM, on_term)
    try:
        for p in processes:
            p.start()
        return supervise(processes, phase, errors)
    finally:
        if os.path.exists(rendezvous):
            os.remove(rendezvous)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    from streambp_conform.warm import delegate

    delegate()  # in a warm worker when STREAMBP_CONFORM_WARM names a server (streambp_conform/warm.py)
    sys.exit(main(sys.argv[1:]))
