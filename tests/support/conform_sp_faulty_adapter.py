#!/usr/bin/env python3
"""Sequence-parallel adapters that `streambp conform` must fail (issue #45): verify/conform/hf_sp_adapter.py with one
piece of its SequenceSplit replaced. MODE:
  own-count       each rank's token losses over its own shard's target count, the gradients summed;
  rank-mean       the global count, the gradients averaged over the ranks instead of summed (1/W too small);
  mean-of-means   each rank's own mean, averaged: right only when every shard holds as many targets;
  drop-remainder  shards of T // W positions, the last T mod W dropped (DeepSpeed #7384's split);
  die             rank 1 kills itself (SIGKILL) while computing its shard;
  hang            rank 1 never returns from computing its shard (conform's --timeout must end it, naming it).
Usage: conform_sp_faulty_adapter.py MODE CASE_DIR
"""
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "verify" / "conform"))
from streambp_conform.warm import delegate  # noqa: E402

delegate()  # in a warm worker when STREAMBP_CONFORM_WARM names a server (streambp_conform/warm.py)
import hf_sp_adapter  # noqa: E402


class OwnCount(hf_sp_adapter.SequenceSplit):
    def rank_loss(self, token_sum, own_count, global_count):
        return token_sum / own_count


class RankMean(hf_sp_adapter.SequenceSplit):
    def reduce(self, dist, grad, world):
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        grad /= world


class MeanOfMeans(OwnCount, RankMean):
    pass


class DropRemainder(hf_sp_adapter.SequenceSplit):
    def shard(self, T, rank, world):
        return slice(rank * (T // world), (rank + 1) * (T // world))


class Die(hf_sp_adapter.SequenceSplit):
    def shard(self, T, rank, world):
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().shard(T, rank, world)


class Hang(hf_sp_adapter.SequenceSplit):
    def shard(self, T, rank, world):
        if rank == 1:
            time.sleep(3600)
        return super().shard(T, rank, world)


MODES = {"own-count": OwnCount, "rank-mean": RankMean, "mean-of-means": MeanOfMeans,
         "drop-remainder": DropRemainder, "die": Die, "hang": Hang}

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in MODES:
        sys.exit(f"usage: conform_sp_faulty_adapter.py {{{'|'.join(MODES)}}} CASE_DIR")
    sys.exit(hf_sp_adapter.main(sys.argv[2:], MODES[sys.argv[1]]()))
