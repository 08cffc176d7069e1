// Attention of one rank's share of a sequence split over a sequence-parallel group (issue #32, ARCHITECTURE.md §16):
// all-gather context parallelism. Every rank computes the K/V of its own positions, the group all-gathers them (each
// rank then holds the layer's whole K/V, as StreamBP holds them for its chunk loop anyway), each rank attends its
// queries causally over the prefix each needs, and in the backward the K/V gradients every rank made for every
// position are reduce-scattered: each rank receives the SUM over the group at its own positions. No head count needs
// to divide by the group size (GQA with fewer KV heads than ranks works as it is).
#pragma once

#include <ATen/core/Tensor.h>

#include "core/model/kv_source.h"
#include "core/model/sequence_shard.h"

namespace sbp {

// `shard`, checked to have `rows` positions (a rank handed other rows would attend the wrong positions).
SequenceShard checked_shard(const SequenceShard& shard, std::int64_t rows);
// The shard's positions of `whole` along `dim`, in shard order.
at::Tensor shard_positions(const SequenceShard& shard, const at::Tensor& whole, std::int64_t dim);

// The K/V source of a rank of a sequence-parallel group: the exchanges below, over a Communicator in
// core/training/sequence_parallel.h. The rest of KVSource follows from them and the rank's shard.
class KVExchange : public WholeKV {
 public:
  // This rank's positions; gather, scatter_sum and sum_over_group are the group's collectives.
  virtual const SequenceShard& shard() const = 0;

  // Checks that `rows` are this rank's shard (a rank handed other rows would attend the wrong positions).
  SequenceShard shard_of(std::int64_t rows) const override { return checked_shard(shard(), rows); }
  bool is_local() const override { return false; }
  at::Tensor own_positions(const at::Tensor& whole, std::int64_t dim) const override {
    return shard_positions(shard(), whole, dim);
  }
  // K and V stacked into one exchange (gather_sequence).
  std::pair<at::Tensor, at::Tensor> gather_with_graph(const at::Tensor& k, const at::Tensor& v) override;
};

// Differentiable gather: the forward is exchange.gather, the backward exchange.scatter_sum. `exchange` must outlive
// the graph's backward.
at::Tensor gather_sequence(KVExchange& exchange, const at::Tensor& local);

// This rank's queries q [B, n_h, t, hd] (its positions, shard order) over the whole sequence's k, v
// [B, n_kv, T, hd]: each block [s, e) of the shard attends to keys [0, e) with the causal rule aligned at s
// (prefix_attention; a local source's one block [0, T) is one process's attention); on packed rows each of the block's
// queries within its own sequence, from that sequence's start (packed_attention: a sequence begun on another rank's
// block reads its keys there, and nothing before its start). Differentiable in q, k and v.
at::Tensor shard_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const SequenceShard& shard,
                           const AttentionRule& rule);

}  // namespace sbp
