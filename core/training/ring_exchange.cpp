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

// f(offset, length, causal) for the keys of `owner`'s block (local offsets into it) that queries at global positions
// [p, p + c) see: its parts before p in full; the part holding the queries (the rank's own block only: a chunk never
// crosses one of its shard's parts) up to p in full, then [p, p + c) under the causal rule; nothing after p + c.
template <typename F>
void for_each_visible(const SequenceShard& owner, std::int64_t p, std::int64_t c, F&& f) {
  owner.for_each_block([&](const SequenceShard::Block& b, std::int64_t offset) {
    if (b.start >= p + c) return;
    if (b.end <= p) return f(offset, b.length(), false);
    TORCH_CHECK(b.start <= p && p + c <= b.end, "ring attention: queries [", p, ", ", p + c, ") cross the key block [",
                b.start, ", ", b.end, ")");
    if (p > b.start) f(offset, p - b.start, false);
    f(offset + p - b.start, c, true);
  });
}

std::vector<at::Tensor> per_chunk(const at::Tensor& x, const std::vector<ChunkRows>& chunks) {
  std::vector<at::Tensor> out;
  for (const auto& r : chunks) out.push_back(x.narrow(2, r.s, r.length()));
  return out;
}

// Standard BP's and checkpointing's attention over the ring (RingExchange::attend_shard): the rank's blocks as chunks.
struct RingAttention : public torch::autograd::Function<RingAttention> {
  // The ring travels as an address: AutogradContext keeps IValues only, and the ring outlives the graph.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, RingExchange* ring, double scale) {
    const auto chunks = ring->chunks(q.size(2), q.size(2));
    const auto merged =
        ring->ring_forward(chunks, per_chunk(q, chunks), pad_positions(at::stack({k, v}), ring->padded_length()), scale);
    const auto o = cat_or_one(merged.o, 2), lse = cat_or_one(merged.lse, 2);
    ctx->save_for_backward({q, k, v, o, lse});
    ctx->saved_data["ring"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(ring));
    ctx->saved_data["scale"] = scale;
    return o.to(q.scalar_type());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* ring = reinterpret_cast<RingExchange*>(static_cast<std::intptr_t>(ctx->saved_data["ring"].toInt()));
    const auto scale = ctx->saved_data["scale"].toDouble();
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &o = saved[3], &lse = saved[4];
    const auto chunks = ring->chunks(q.size(2), q.size(2));
    RingExchange::Merged merged{per_chunk(o, chunks), per_chunk(lse, chunks)};
    auto dq = at::zeros_like(o);
    auto dq_chunks = per_chunk(dq, chunks);
    const auto sums = ring->ring_backward(chunks, per_chunk(q, chunks), per_chunk(grads[0].to(o.scalar_type()), chunks),
                                          merged, pad_positions(at::stack({k, v}), ring->padded_length()), scale,
                                          o.scalar_type(), dq_chunks);
    const auto t = q.size(2);
    return {dq.to(q.scalar_type()), sums[0].narrow(-2, 0, t).to(k.scalar_type()),
            sums[1].narrow(-2, 0, t).to(v.scalar_type()), at::Tensor(), at::Tensor()};
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
                                                const at::Tensor& kv, double scale) {
  const int N = comm_.world_size();
  std::vector<SoftmaxState> states(chunks.size());
  at::Tensor block = kv;  // [2, B, n_kv, padded, hd]: whose, owner(hop)
  for (int hop = 0; hop < N; ++hop) {
    const auto K = block[0], V = block[1];
    for (std::size_t i = 0; i < chunks.size(); ++i)
      for_each_visible(owner(hop), chunks[i].position, chunks[i].length(),
                       [&](std::int64_t offset, std::int64_t length, bool causal) {
                         merge_key_block(states[i], q[i], K.narrow(2, offset, length), V.narrow(2, offset, length),
                                         causal, scale);
                       });
    if (hop + 1 < N) block = pass_on(block, Cargo::keys, hop);
  }
  Merged out;
  for (auto& s : states) {
    out.o.push_back(std::move(s.o));
    out.lse.push_back(std::move(s.lse));
  }
  return out;
}

at::Tensor RingExchange::ring_backward(const std::vector<ChunkRows>& chunks, const std::vector<at::Tensor>& q,
                                       const std::vector<at::Tensor>& grad_o, const Merged& merged,
                                       const at::Tensor& kv, double scale, c10::ScalarType sum_dtype,
                                       std::vector<at::Tensor>& dq) {
  const int N = comm_.world_size();
  at::Tensor block = kv, sums = at::zeros(kv.sizes(), kv.options().dtype(sum_dtype));  // both owner(hop)'s
  for (int hop = 0; hop < N; ++hop) {
    const auto K = block[0], V = block[1], dK = sums[0], dV = sums[1];
    for (std::size_t i = 0; i < chunks.size(); ++i) {
      const SoftmaxState state{merged.o[i], merged.lse[i]};
      for_each_visible(owner(hop), chunks[i].position, chunks[i].length(),
                       [&](std::int64_t offset, std::int64_t length, bool causal) {
                         auto dk = dK.narrow(2, offset, length), dv = dV.narrow(2, offset, length);
                         key_block_backward(grad_o[i], q[i], K.narrow(2, offset, length),
                                            V.narrow(2, offset, length), state, causal, scale, dq[i], dk, dv);
                       });
    }
    if (hop + 1 < N) {
      block = pass_on(block, Cargo::keys, hop);
      sums = pass_on(sums, Cargo::key_gradients, hop);
    }
  }
  // After N - 1 hops a rank holds the next rank's block: one more hop takes every block's sums home.
  if (N > 1) sums = pass_on(sums, Cargo::home, N - 1);
  return sums;
}

at::Tensor RingExchange::attend_shard(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  return RingAttention::apply(q, k, v, this, scale);
}

void RingExchange::stream_forward(at::Tensor kv, std::int64_t c, double scale, StreamedForward& layer) {
  const auto chunks = this->chunks(kv.size(3), c);
  std::vector<at::Tensor> q;  // per chunk [B, n_h, c, hd]
  for (const auto& r : chunks) q.push_back(layer.q(r));
  const auto dtype = q.front().scalar_type();
  auto merged = ring_forward(chunks, q, pad_positions(std::exchange(kv, at::Tensor()), padded_), scale);
  q.clear();
  merged.lse.clear();
  for (std::size_t i = 0; i < chunks.size(); ++i) layer.output(chunks[i], std::exchange(merged.o[i], {}).to(dtype));
}

at::Tensor RingExchange::stream_backward(at::Tensor kv, std::int64_t c, double scale, c10::ScalarType sum_dtype,
                                         StreamedBackward& layer) {
  const auto rows = kv.size(3);
  const auto chunks = this->chunks(rows, c);
  const auto padded = pad_positions(std::exchange(kv, at::Tensor()), padded_);
  std::vector<at::Tensor> q;  // per chunk [B, n_h, c, hd]
  for (const auto& r : chunks) q.push_back(layer.q(r));
  const auto dtype = q.front().scalar_type();
  // The forward's merge again (nothing of it was kept), then each chunk's dO through the rest of the layer.
  const auto merged = ring_forward(chunks, q, padded, scale);
  std::vector<at::Tensor> grad_o, dq;
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    grad_o.push_back(layer.output_backward(chunks[i], merged.o[i].to(dtype)).to(merged.o[i].scalar_type()));
    dq.push_back(at::zeros_like(merged.o[i]));
  }
  const auto sums = ring_backward(chunks, q, grad_o, merged, padded, scale, sum_dtype, dq);
  for (std::size_t i = 0; i < chunks.size(); ++i) layer.q_backward(chunks[i], dq[i].to(dtype));
  return sums.narrow(-2, 0, rows);
}

}  // namespace sbp
