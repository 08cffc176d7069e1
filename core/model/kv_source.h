// Where a layer's keys and values come from (ARCHITECTURE.md §16): the one seam through which sequence parallelism
// enters the model and the methods. The model holds a source (local by default) and asks it, as StreamBP's chunk loops
// and the streamed head do, for the positions this process holds, for the attention of its queries over every key
// of the sequence and for the group's sums; none of them branches on where the keys are. Two kinds:
//  - WholeKV: the whole sequence's K/V at hand (the local source, whose answers are the identity, so that a local step
//    does exactly one process's floating-point work; the all-gather, KVExchange in core/model/context_attention.h);
//  - keys that arrive block by block (the ring, core/training/ring_exchange.h): no process holds them all.
// A streamed layer (StreamBP) hands the source its pieces around attention (StreamedForward, StreamedBackward) and the
// source runs the chunk loop over them: each chunk at once with the whole K/V, or every chunk per key block.
#pragma once

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include "core/model/sequence_shard.h"

namespace sbp {

struct KVGradSums;  // core/model/chunk_attention.h
class PackedRows;   // core/model/packed_rows.h

// What decides which keys a query sees: the softmax scale and, for packed rows, the rows' sequences (null: one
// sequence per row). A source that cuts the attention itself (the ring, shard_attention) keeps every query within its
// own sequence, wherever that sequence's earlier positions live (ARCHITECTURE.md §16 "Packed rows").
struct AttentionRule {
  double scale = 1.0;
  const PackedRows* packed = nullptr;  // the whole batch's rows, global positions
};

// A chunk of this process's rows [s, e), `position` the global position of row s.
struct ChunkRows {
  std::int64_t s = 0, e = 0, position = 0;
  std::int64_t length() const { return e - s; }
};

// A streamed layer's forward around its attention (no graph).
class StreamedForward {
 public:
  virtual ~StreamedForward() = default;
  // The whole sequence's K, V [B, n_kv, T, hd] at hand: the chunk's queries attend the prefix, and the layer goes on.
  virtual void chunk(const ChunkRows& rows, const at::Tensor& K, const at::Tensor& V) = 0;
  // Keys block by block: the chunk's queries [B, n_h, c, hd], then, once every block is merged, its attention output
  // o [B, n_h, c, hd] (the queries' dtype) for the rest of the layer.
  virtual at::Tensor q(const ChunkRows& rows) = 0;
  virtual void output(const ChunkRows& rows, const at::Tensor& o) = 0;
};

// A streamed layer's backward around its attention: each piece back-propagates its part of the chunk into the layer's
// input gradient and weight sums.
class StreamedBackward {
 public:
  virtual ~StreamedBackward() = default;
  // The whole sequence's K, V at hand: the chunk's backward, the K/V gradients of its prefix added into `sums`.
  virtual void chunk(const ChunkRows& rows, const at::Tensor& K, const at::Tensor& V, const KVGradSums& sums) = 0;
  // Keys block by block: the chunk's queries (no graph); the backward from the layer's output to the attention output
  // o (-> dO [B, n_h, c, hd]); then, once every block is through, the backward of the queries from dq.
  virtual at::Tensor q(const ChunkRows& rows) = 0;
  virtual at::Tensor output_backward(const ChunkRows& rows, const at::Tensor& o) = 0;
  virtual void q_backward(const ChunkRows& rows, const at::Tensor& dq) = 0;
};

class KVSource {
 public:
  virtual ~KVSource() = default;
  // The positions of the `rows` rows this process holds: local, one block [0, rows) of a sequence of `rows`.
  virtual SequenceShard shard_of(std::int64_t rows) const = 0;
  // Whether this process holds whole sequences and exchanges nothing. When not (a group, even of one), an objective's
  // row statistics are summed over the group before any term, and only methods that run on shards may step.
  virtual bool is_local() const = 0;
  // Whether one chunk of at most c of this process's `rows` rows is the whole sequence, so that what couples a row's
  // positions (an objective's row statistics) is complete within it: locally when c >= rows; never in a group, even
  // of one (its statistics are summed over the group). A streamed head runs a statistics pass when it is not.
  bool chunk_holds_sequence(std::int64_t rows, std::int64_t c) const { return is_local() && c >= rows; }
  // This process's positions of `whole` along `dim`, in shard order: `whole` itself for a local source.
  virtual at::Tensor own_positions(const at::Tensor& whole, std::int64_t dim) const = 0;
  // `values` summed over the group in place (an objective's row statistics: each rank saw its positions).
  virtual void sum_over_group(at::Tensor& values) = 0;

  // With a graph: this process's queries q [B, n_h, t, hd] over every key of the sequence, causally, given this
  // process's k, v [B, n_kv, t, hd] (its positions, shard order) -> o [B, n_h, t, hd]; the backward gives each process
  // the group's gradient sums at its own positions.
  virtual at::Tensor attend_shard(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const AttentionRule& rule) = 0;
  // A streamed layer, chunks of at most c of this process's rows: `kv` [2, B, n_kv, t, hd] its K and V (taken: the
  // source frees them when it can). The forward hands each chunk's attention to `layer`; the backward returns the K/V
  // gradients at this process's positions [2, B, n_kv, t, hd] in `sum_dtype`, summed over the group and every chunk.
  virtual void stream_forward(at::Tensor kv, std::int64_t c, const AttentionRule& rule, StreamedForward& layer) = 0;
  virtual at::Tensor stream_backward(at::Tensor kv, std::int64_t c, const AttentionRule& rule,
                                     c10::ScalarType sum_dtype, StreamedBackward& layer) = 0;

  // f(s, e, position) for chunks of at most c of this process's `rows` rows: rows [s, e), `position` the global
  // position of row s; a chunk never crosses one of the shard's blocks (c >= rows: one chunk per block).
  void for_each_chunk(std::int64_t rows, std::int64_t c,
                      const std::function<void(std::int64_t s, std::int64_t e, std::int64_t position)>& f) const;
  std::vector<ChunkRows> chunks(std::int64_t rows, std::int64_t c) const;
};

// A source that makes the whole sequence's K/V for each process: gather and scatter_sum, and every answer above from
// them (each chunk attends its prefix of the whole K/V; its K/V gradients are summed over the whole sequence and
// scatter-summed once per layer).
class WholeKV : public KVSource {
 public:
  // Without a graph: this process's K and V [..., t, hd] -> the whole sequence's [..., T, hd].
  virtual at::Tensor gather(const at::Tensor& local) = 0;
  // With a graph: k, v [B, n_kv, t, hd] -> the whole sequence's [B, n_kv, T, hd]; the backward makes each rank's
  // gradients the group's sum at its positions.
  virtual std::pair<at::Tensor, at::Tensor> gather_with_graph(const at::Tensor& k, const at::Tensor& v) = 0;
  // The whole sequence's [..., T, hd] made here -> the SUM over the group at this process's positions [..., t, hd].
  virtual at::Tensor scatter_sum(const at::Tensor& whole) = 0;

  at::Tensor attend_shard(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const AttentionRule& rule) override;
  // The whole K/V at hand: each chunk's attention is the layer's own (Model::attend, which reads the packed rows).
  void stream_forward(at::Tensor kv, std::int64_t c, const AttentionRule& rule, StreamedForward& layer) override;
  at::Tensor stream_backward(at::Tensor kv, std::int64_t c, const AttentionRule& rule, c10::ScalarType sum_dtype,
                             StreamedBackward& layer) override;
};

// The source of one process holding whole sequences (what a Model holds unless given another).
KVSource& local_kv_source();

// x.narrow(dim, start, length), or x itself when that is all of x: a narrow's backward pads a zero-filled copy of x.
at::Tensor narrow_or_whole(const at::Tensor& x, std::int64_t dim, std::int64_t start, std::int64_t length);
// at::cat(parts, dim), or the one part itself (a cat of one copies it).
at::Tensor cat_or_one(const std::vector<at::Tensor>& parts, std::int64_t dim);

}  // namespace sbp
