#!/usr/bin/env python3
"""HF Transformers under torch's DistributedDataParallel on the case's ranks (case.json "ranks"; Gloo on the CPU):
the distributed adapter of the conformance protocol, judged like every other against one process's gradients.

Each rank takes its consecutive rows of the batch. DDP averages the ranks' gradients, so what a rank back-propagates
is its rows' share of the whole batch's loss times the world size: for SFT the sum of its token losses over the
*batch's* target count. `--per-rank-mean` is the usual mistake instead (each rank its own rows' mean, then DDP's
average), which is right only when every rank holds as many targets: the negative control, failing the ragged cases.
SFT only; other objectives are not expressible here.

Usage: hf_ddp_adapter.py [--per-rank-mean] CASE_DIR
"""
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from streambp_conform.warm import delegate  # noqa: E402

delegate()  # in a warm worker when STREAMBP_CONFORM_WARM names a server (streambp_conform/warm.py)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import losses  # noqa: E402
import protocol  # noqa: E402


def rank_rows(rows, rank, world):
    """Consecutive rows, the first rows % world ranks one more."""
    per, extra = divmod(rows, world)
    start = rank * per + min(rank, extra)
    return slice(start, start + per + (1 if rank < extra else 0))


def worker(rank, world, case_dir, rendezvous, per_rank_mean, out):
    torch.set_num_threads(1)  # the ranks share the machine's cores
    # Gloo's pairs on the loopback interface, as the harness's own ranks (core/training/c10d_communicator.cpp): its
    # default is the address the host name resolves to, which need not be this machine's reachable one.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        case = protocol.read_case(case_dir)
        model, trainable = protocol.load_model(case)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        b = case.batch
        rows = rank_rows(b["input_ids"].size(0), rank, world)
        targets = F.pad(b["labels"], (0, 1), value=-100)[:, 1:]  # position t predicts token t + 1
        start = time.perf_counter()
        logits = losses.forward_logits(ddp, {"input_ids": b["input_ids"][rows], "attention_mask": b["attention_mask"][rows]})
        mine = targets[rows].flatten()
        token_sum = F.cross_entropy(logits.flatten(0, 1), mine, ignore_index=-100, reduction="sum")
        if per_rank_mean:
            share = token_sum / (mine != -100).sum()
            loss = share
        else:
            share = token_sum / (targets != -100).sum()
            loss = share * world  # DDP divides the summed gradients by the world size
        loss.backward()
        seconds = time.perf_counter() - start
        total = share.detach().clone()
        dist.all_reduce(total)  # the batch's loss (per-rank means: their sum, which is what the bug reports)
        if rank == 0:
            grads = {n: p.grad.detach().to(case.dtype).contiguous() for n, p in trainable.items()}
            protocol.write_outputs(case, (total / world if per_rank_mean else total).item(), grads, seconds)
    except protocol.CaseError as e:
        out.put(str(e))
        raise
    finally:
        dist.destroy_process_group()


def main(argv):
    per_rank_mean = "--per-rank-mean" in argv
    args = [a for a in argv if a != "--per-rank-mean"]
    if len(args) != 1 or args[0].startswith("-"):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    try:
        # packs=False: its ranks hand HF an attention_mask, which would attend across packed sequences
        case = protocol.read_case(args[0], packs=False)
        if case.parallel != "data":
            raise protocol.NotExpressible(f"parallel {case.parallel}: this adapter splits the rows (hf_sp_adapter.py "
                                          "splits the sequence)")
        if case.objective["name"] != "sft":
            raise protocol.NotExpressible(f"objective {case.objective['name']}: this adapter splits SFT's rows only")
        if case.lora:
            raise protocol.NotExpressible("LoRA: this adapter wraps the full model in DDP only")
        if case.ranks > case.batch["input_ids"].size(0):
            raise protocol.NotExpressible(f"{case.ranks} ranks for {case.batch['input_ids'].size(0)} rows")
    except protocol.CaseError as e:
        print(f"{Path(args[0]).name}: {e}", file=sys.stderr)
        return 2
    except protocol.NotExpressible as e:
        print(f"{Path(args[0]).name}: {e}", file=sys.stderr)
        return protocol.NOT_EXPRESSIBLE
    fd, rendezvous = tempfile.mkstemp(prefix=".ddp-rendezvous-", dir=case.dir)
    os.close(fd)
    os.remove(rendezvous)  # init_method file:// wants a path that does not exist yet (or an empty file)
    errors = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(worker, args=(case.ranks, str(case.dir), rendezvous, per_rank_mean, errors), nprocs=case.ranks)
    except Exception as e:  # a rank's exception, re-raised by spawn with the rank named
        message = errors.get() if not errors.empty() else str(e).strip().splitlines()[-1]
        print(f"{case.dir.name}: {message}", file=sys.stderr)
        return 2
    finally:
        if os.path.exists(rendezvous):
            os.remove(rendezvous)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
