// Attention of one rank's share of a sequence split over a sequence-parallel group (issue #32, ARCHITECTURE.md §16):
// all-gather context parallelism. Every rank computes the K/V of its own positions, the group all-gathers them (each
// rank then holds the layer's whole K/V, as StreamBP holds them for its chunk loop anyway), each rank attends its
// queries causally over the prefix each needs, and in the backward the K/V gradients every rank made for every
// position are reduce-scattered: each rank receives the SUM over the group at its own positions. No head count needs
// to divide by the group size (GQA with fewer KV heads than ranks works as it is).
#pragma once

#include <ATen/core/Tensor.h>

#include "core/model/sequence_shard.h"

namespace sbp {

// How a layer's K/V move among the group's ranks. The model layer sees only this; the implementation over a
// Communicator is core/training/sequence_parallel.h.
class KVExchange {
 public:
  virtual ~KVExchange() = default;
  virtual const SequenceShard& shard() const = 0;
  // This rank's [..., t, hd] (its positions, shard order) -> the whole sequence's [..., T, hd], every rank's
  // positions in place.
  virtual at::Tensor gather(const at::Tensor& local) = 0;
  // The whole sequence's [..., T, hd] made on this rank -> the SUM over the group's ranks at this rank's positions
  // [..., t, hd].
  virtual at::Tensor scatter_sum(const at::Tensor& whole) = 0;
  // `values` summed over the group's ranks in place (an objective's row statistics: each rank saw its positions).
  virtual void sum_over_group(at::Tensor& values) = 0;
};

// Differentiable gather: the forward is exchange.gather, the backward exchange.scatter_sum. `exchange` must outlive
// the graph's backward.
at::Tensor gather_sequence(KVExchange& exchange, const at::Tensor& local);

// This rank's queries q [B, n_h, t, hd] (its positions, shard order) over the whole sequence's k, v
// [B, n_kv, T, hd]: each block [s, e) of the shard attends to keys [0, e) with the causal rule aligned at s
// (prefix_attention). Differentiable in q, k and v.
at::Tensor shard_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const SequenceShard& shard,
                           double scale);

}  // namespace sbp
