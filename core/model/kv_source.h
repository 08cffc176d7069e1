// Where a layer's keys and values come from (ARCHITECTURE.md §16): the one seam through which sequence parallelism
// enters the model and the methods. The model holds a source (local by default) and asks it, as StreamBP's chunk loops
// and the streamed head do, for the positions this process holds, the whole sequence's K/V and the group's sums; none
// of them branches on where the K/V come from. The local source holds whole sequences: its answers are the identity
// (the same tensors, never a copy), so a local step does exactly the floating-point work of one process. The exchanged
// one is KVExchange (core/model/context_attention.h).
#pragma once

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/model/sequence_shard.h"

namespace sbp {

class KVSource {
 public:
  virtual ~KVSource() = default;
  // The positions of the `rows` rows this process holds: local, one block [0, rows) of a sequence of `rows`.
  virtual SequenceShard shard_of(std::int64_t rows) const = 0;
  // Whether this process holds whole sequences and exchanges nothing. When not (a group, even of one), an objective's
  // row statistics are summed over the group before any term, and only methods that run on shards may step.
  virtual bool is_local() const = 0;
  // This process's positions of `whole` along `dim`, in shard order: `whole` itself for a local source.
  virtual at::Tensor own_positions(const at::Tensor& whole, std::int64_t dim) const = 0;
  // Without a graph: this process's K and V [..., t, hd] -> the whole sequence's [..., T, hd].
  virtual at::Tensor gather(const at::Tensor& local) = 0;
  // With a graph: k, v [B, n_kv, t, hd] -> the whole sequence's [B, n_kv, T, hd]; the backward makes each rank's
  // gradients the group's sum at its positions.
  virtual std::pair<at::Tensor, at::Tensor> gather_with_graph(const at::Tensor& k, const at::Tensor& v) = 0;
  // The whole sequence's [..., T, hd] made here -> the SUM over the group at this process's positions [..., t, hd].
  virtual at::Tensor scatter_sum(const at::Tensor& whole) = 0;
  // `values` summed over the group in place (an objective's row statistics: each rank saw its positions).
  virtual void sum_over_group(at::Tensor& values) = 0;

  // f(s, e, position) for chunks of at most c of this process's `rows` rows: rows [s, e), `position` the global
  // position of row s; a chunk never crosses one of the shard's blocks (c >= rows: one chunk per block).
  void for_each_chunk(std::int64_t rows, std::int64_t c,
                      const std::function<void(std::int64_t s, std::int64_t e, std::int64_t position)>& f) const;
};

// The source of one process holding whole sequences (what a Model holds unless given another).
KVSource& local_kv_source();

// x.narrow(dim, start, length), or x itself when that is all of x: a narrow's backward pads a zero-filled copy of x.
at::Tensor narrow_or_whole(const at::Tensor& x, std::int64_t dim, std::int64_t start, std::int64_t length);
// at::cat(parts, dim), or the one part itself (a cat of one copies it).
at::Tensor cat_or_one(const std::vector<at::Tensor>& parts, std::int64_t dim);

}  // namespace sbp
