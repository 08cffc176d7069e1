#include "core/model/kv_source.h"

#include <algorithm>

#include <ATen/ATen.h>

#include "core/model/chunk_attention.h"
#include "core/model/context_attention.h"

namespace sbp {

namespace {

// Whole sequences on one process: every answer is the tensor asked about, so that the model and the methods do
// exactly one process's work through the same calls an exchange answers.
class LocalKV final : public WholeKV {
 public:
  SequenceShard shard_of(std::int64_t rows) const override { return {0, 1, rows, {{0, rows}}}; }
  bool is_local() const override { return true; }
  at::Tensor own_positions(const at::Tensor& whole, std::int64_t) const override { return whole; }
  at::Tensor gather(const at::Tensor& local) override { return local; }
  std::pair<at::Tensor, at::Tensor> gather_with_graph(const at::Tensor& k, const at::Tensor& v) override {
    return {k, v};
  }
  at::Tensor scatter_sum(const at::Tensor& whole) override { return whole; }
  void sum_over_group(at::Tensor&) override {}
};

}  // namespace

void KVSource::for_each_chunk(std::int64_t rows, std::int64_t c,
                              const std::function<void(std::int64_t s, std::int64_t e, std::int64_t position)>& f) const {
  shard_of(rows).for_each_block([&](const SequenceShard::Block& b, std::int64_t offset) {
    for (std::int64_t s = 0; s < b.length(); s += c) f(offset + s, offset + std::min(b.length(), s + c), b.start + s);
  });
}

std::vector<ChunkRows> KVSource::chunks(std::int64_t rows, std::int64_t c) const {
  std::vector<ChunkRows> out;
  for_each_chunk(rows, c, [&](std::int64_t s, std::int64_t e, std::int64_t position) { out.push_back({s, e, position}); });
  return out;
}

at::Tensor WholeKV::attend_shard(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const AttentionRule& rule) {
  const auto kv = gather_with_graph(k, v);  // [B, n_kv, T, hd]: an exchange's one all-gather for K and V
  return shard_attention(q, kv.first, kv.second, shard_of(q.size(2)), rule);
}

void WholeKV::stream_forward(at::Tensor kv, std::int64_t c, const AttentionRule&, StreamedForward& layer) {
  const auto rows = kv.size(3);
  const auto KV = gather(kv);  // [2, B, n_kv, T, hd]: K and V in one exchange
  kv.reset();
  for_each_chunk(rows, c, [&](std::int64_t s, std::int64_t e, std::int64_t position) {
    layer.chunk({s, e, position}, KV[0], KV[1]);
  });
}

at::Tensor WholeKV::stream_backward(at::Tensor kv, std::int64_t c, const AttentionRule&, c10::ScalarType sum_dtype,
                                    StreamedBackward& layer) {
  const auto rows = kv.size(3);
  auto KV = gather(kv);  // [2, B, n_kv, T, hd]
  kv.reset();
  // dK/dV sum every chunk's contribution to the K/V prefix, over the whole sequence, in one block as the scatter
  // takes it back.
  auto dKV = at::zeros(KV.sizes(), KV.options().dtype(sum_dtype));
  {
    const KVGradSums sums{dKV[0], dKV[1]};
    const auto K = KV[0], V = KV[1];
    for_each_chunk(rows, c, [&](std::int64_t s, std::int64_t e, std::int64_t position) {
      layer.chunk({s, e, position}, K, V, sums);
    });
  }
  KV.reset();
  // Once per layer, after the last chunk (never per chunk): the sums at the rows held here (an exchange: the group's,
  // reduce-scattered; locally the sums themselves).
  return scatter_sum(std::exchange(dKV, at::Tensor()));
}

KVSource& local_kv_source() {
  static LocalKV local;
  return local;
}

at::Tensor narrow_or_whole(const at::Tensor& x, std::int64_t dim, std::int64_t start, std::int64_t length) {
  return start == 0 && length == x.size(dim) ? x : x.narrow(dim, start, length);
}

at::Tensor cat_or_one(const std::vector<at::Tensor>& parts, std::int64_t dim) {
  return parts.size() == 1 ? parts.front() : at::cat(parts, dim);
}

}  // namespace sbp
