#include "core/training/ring_exchange.h"

#include <algorithm>
#include <utility>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "core/model/chunk_attention.h"
#include "core/model/context_attention.h"
#include "core/training/sequence_parallel.h"

namespace sbp {

namespace {

// x [B, heads, c, ...] at run's rows and queries (a view; x itself when that is all of it).
at::Tensor ring_run_rows(const at::Tensor& x, const QueryRun& run) {
  return narrow_or_whole(narrow_or_whole(x, 0, run.row, run.rows), 2, run.offset, run.length);
}

// x [B, heads, n, hd] at run's rows and the keys of `range` (a view).
at::Tensor ring_range_rows(const at::Tensor& x, const QueryRun& run, const KeyRange& range) {
  return narrow_or_whole(x, 0, run.row, run.rows).narrow(2, range.offset, range.length);
}

// A chunk's per-run pieces [rows, heads, length, ...] put back into [B, heads, c, ...]: each row's runs along the
// queries, then the rows (runs come row after row, query_runs).
at::Tensor ring_chunk_of_runs(const std::vector<at::Tensor>& pieces, const std::vector<QueryRun>& runs) {
  std::vector<at::Tensor> rows, row;
  for (std::size_t j = 0; j < runs.size(); ++j) {
    row.push_back(pieces[j]);
    if (j + 1 == runs.size() || runs[j + 1].row != runs[j].row) rows.push_back(cat_or_one(std::exchange(row, {}), 2));
  }
  return cat_or_one(rows, 0);
}

std::vector<at::Tensor> per_chunk(const at::Tensor& x, const std::vector<ChunkRows>& chunks) {
  std::vector<at::Tensor> out;
  for (const auto& r : chunks) out.push_back(x.narrow(2, r.s, r.length()));
  return out;
}

// Standard BP's and checkpointing's attention over the ring (RingExchange::attend_shard): the rank's blocks as chunks.
struct RingAttention : public torch::autograd::Function<RingAttention> {
  // The ring travels as an address: AutogradContext keeps IValues only, and the ring outlives the graph.
  // So does the rule's packed rows, which the step holds until after the backward.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, RingExchange* ring, double scale, const PackedRows* packed) {
    const auto chunks = ring->chunks(q.size(2), q.size(2));
    const auto merged = ring->ring_forward(chunks, per_chunk(q, chunks),
                                           pad_positions(at::stack({k, v}), ring->padded_length()), {scale, packed});
    const auto o = cat_or_one(merged.o, 2), lse = cat_or_one(merged.lse, 2);
    ctx->save_for_backward({q, k, v, o, lse});
    ctx->saved_data["ring"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(ring));
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["packed"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(packed));
    return o.to(q.scalar_type());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* ring = reinterpret_cast<RingExchange*>(static_cast<std::intptr_t>(ctx->saved_data["ring"].toInt()));
    const AttentionRule rule{ctx->saved_data["scale"].toDouble(),
                             reinterpret_cast<const PackedRows*>(static_cast<std::intptr_t>(ctx->saved_data["packed"].toInt()))};
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &o = saved[3], &lse = saved[4];
    const auto chunks = ring->chunks(q.size(2), q.size(2));
    // dO stays in the model dtype (bf16 values are bf16 already): key_block_backward widens it part by part.
    const auto grad_o = per_chunk(ring->held_grad_output(grads[0]), chunks), o_chunks = per_chunk(o, chunks),
               lse_chunks = per_chunk(lse, chunks);
    std::vector<BackwardRows> rows;
    for (std::size_t i = 0; i < chunks.size(); ++i) rows.push_back({lse_chunks[i], output_rowsum(grad_o[i], o_chunks[i])});
    auto dq = at::zeros_like(o);
    auto dq_chunks = per_chunk(dq, chunks);
    const auto sums = ring->ring_backward(chunks, per_chunk(q, chunks), grad_o, rows, pad_positions(at::stack({k, v}), ring->padded_length()), rule,
                                          o.scalar_type(), dq_chunks);
    const auto t = q.size(2);
    return {dq.to(q.scalar_type()), sums[0].narrow(-2, 0, t).to(k.scalar_type()),
            sums[1].narrow(-2, 0, t).to(v.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

RingExchange::RingExchange(Communicator& comm, std::int64_t seq_len)
    : comm_(comm), shards_(zigzag_shards(seq_len, comm.world_size())),
      padded_(longest_zigzag_shard(seq_len, comm.world_size())) {}

SequenceShard RingExchange::shard_of(std::int64_t rows) const { return checked_shard(shard(), rows); }

at::Tensor RingExchange::own_positions(const at::Tensor& whole, std::int64_t dim) const {
  return shard_positions(shard(), whole, dim);
}

void RingExchange::sum_over_group(at::Tensor& values) {
  std::vector<at::Tensor> one = {values};
  comm_.all_reduce_sum(one);
}

const SequenceShard& RingExchange::owner(int hop) const {
  const int N = comm_.world_size();
  return shards_[std::size_t(((comm_.rank() - hop) % N + N) % N)];
}

at::Tensor RingExchange::pass_on(const at::Tensor& block, Cargo, int) { return comm_.ring_shift(block); }

RingExchange::Merged RingExchange::ring_forward(const std::vector<ChunkRows>& chunks, const std::vector<at::Tensor>& q,
                                                const at::Tensor& kv, const AttentionRule& rule) {
  const int N = comm_.world_size();
  std::vector<std::vector<QueryRun>> runs;  // per chunk: its queries grouped by the keys they see
  std::vector<std::vector<SoftmaxState>> states;  // per chunk and run
  for (const auto& r : chunks) {
    runs.push_back(query_runs(r, kv.size(1), rule.packed));
    states.emplace_back(runs.back().size());
  }
  at::Tensor block = kv;  // [2, B, n_kv, padded, hd]: whose, owner(hop)
  for (int hop = 0; hop < N; ++hop) {
    const auto K = block[0], V = block[1];
    for (std::size_t i = 0; i < chunks.size(); ++i)
      for_each_visible_range(owner(hop), chunks[i], runs[i], counts_, [&](std::size_t j, const KeyRange& range) {
        const auto& run = runs[i][j];
        merge_key_block(states[i][j], ring_run_rows(q[i], run), ring_range_rows(K, run, range), ring_range_rows(V, run, range),
                        range.causal, rule.scale);
      });
    if (hop + 1 < N) block = pass_on(block, Cargo::keys, hop);
  }
  Merged out;
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    std::vector<at::Tensor> o, lse;
    for (auto& s : states[i]) {
      o.push_back(std::move(s.o));
      lse.push_back(std::move(s.lse));
    }
    out.o.push_back(ring_chunk_of_runs(o, runs[i]));
    out.lse.push_back(ring_chunk_of_runs(lse, runs[i]));
  }
  return out;
}

at::Tensor RingExchange::ring_backward(const std::vector<ChunkRows>& chunks, const std::vector<at::Tensor>& q,
                                       const std::vector<at::Tensor>& grad_o, const std::vector<BackwardRows>& rows,
                                       const at::Tensor& kv, const AttentionRule& rule, c10::ScalarType sum_dtype,
                                       std::vector<at::Tensor>& dq) {
  const int N = comm_.world_size();
  std::vector<std::vector<QueryRun>> runs;
  for (const auto& r : chunks) runs.push_back(query_runs(r, kv.size(1), rule.packed));
  at::Tensor block = kv, sums = at::zeros(kv.sizes(), kv.options().dtype(sum_dtype));  // both owner(hop)'s
  for (int hop = 0; hop < N; ++hop) {
    const auto K = block[0], V = block[1], dK = sums[0], dV = sums[1];
    for (std::size_t i = 0; i < chunks.size(); ++i)
      for_each_visible_range(owner(hop), chunks[i], runs[i], counts_, [&](std::size_t j, const KeyRange& range) {
        const auto& run = runs[i][j];
        const BackwardRows state{ring_run_rows(rows[i].lse, run), ring_run_rows(rows[i].rowsum, run)};
        auto dq_run = ring_run_rows(dq[i], run);  // views: the kernels add into dq, dK and dV in place
        auto dk = ring_range_rows(dK, run, range), dv = ring_range_rows(dV, run, range);
        key_block_backward(ring_run_rows(grad_o[i], run), ring_run_rows(q[i], run), ring_range_rows(K, run, range),
                           ring_range_rows(V, run, range), state, range.causal, rule.scale, dq_run, dk, dv);
      });
    if (hop + 1 < N) {
      block = pass_on(block, Cargo::keys, hop);
      sums = pass_on(sums, Cargo::key_gradients, hop);
    }
  }
  // After N - 1 hops a rank holds the next rank's block: one more hop takes every block's sums home.
  if (N > 1) sums = pass_on(sums, Cargo::home, N - 1);
  return sums;
}

at::Tensor RingExchange::attend_shard(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const AttentionRule& rule) {
  return RingAttention::apply(q, k, v, this, rule.scale, rule.packed);
}

void RingExchange::stream_forward(at::Tensor kv, std::int64_t c, const AttentionRule& rule, StreamedForward& layer) {
  const auto chunks = this->chunks(kv.size(3), c);
  std::vector<at::Tensor> q;  // per chunk [B, n_h, c, hd]
  for (const auto& r : chunks) q.push_back(layer.q(r));
  const auto dtype = q.front().scalar_type();
  auto merged = ring_forward(chunks, q, pad_positions(std::exchange(kv, at::Tensor()), padded_), rule);
  q.clear();
  merged.lse.clear();
  for (std::size_t i = 0; i < chunks.size(); ++i) layer.output(chunks[i], std::exchange(merged.o[i], {}).to(dtype));
}

at::Tensor RingExchange::stream_backward(at::Tensor kv, std::int64_t c, const AttentionRule& rule,
                                         c10::ScalarType sum_dtype, StreamedBackward& layer) {
  const auto rows = kv.size(3);
  const auto chunks = this->chunks(rows, c);
  const auto padded = pad_positions(std::exchange(kv, at::Tensor()), padded_);
  std::vector<at::Tensor> q;  // per chunk [B, n_h, c, hd]
  for (const auto& r : chunks) q.push_back(layer.q(r));
  const auto dtype = q.front().scalar_type();
  // The forward's merge again (nothing of it was kept), then each chunk's dO through the rest of the layer.
  auto merged = ring_forward(chunks, q, padded, rule);
  // Each chunk's dO is held in the model dtype for the whole ring backward: it is the gradient of o_proj's input, a
  // tensor of that dtype, so in bf16 its values are bf16 already and key_block_backward's widening of each part gives
  // the values a widened copy held here would (half the bytes; fp32 and fp64 hold it as they always did). Of the
  // merged output only rowsum(dO * O) is kept: the chunk's O goes once its dO exists.
  std::vector<at::Tensor> grad_o, dq;
  std::vector<BackwardRows> row_terms;
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    grad_o.push_back(held_grad_output(layer.output_backward(chunks[i], merged.o[i].to(dtype))));
    row_terms.push_back({std::exchange(merged.lse[i], {}), output_rowsum(grad_o[i], merged.o[i])});
    dq.push_back(at::zeros_like(std::exchange(merged.o[i], {})));
  }
  const auto sums = ring_backward(chunks, q, grad_o, row_terms, padded, rule, sum_dtype, dq);
  for (std::size_t i = 0; i < chunks.size(); ++i) layer.q_backward(chunks[i], dq[i].to(dtype));
  return sums.narrow(-2, 0, rows);
}

}  // namespace sbp
