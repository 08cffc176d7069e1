#include "core/model/context_attention.h"

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "core/model/chunk_attention.h"
#include "core/model/packed_attention.h"

namespace sbp {

namespace {

struct GatherSequence : public torch::autograd::Function<GatherSequence> {
  // The exchange travels as an address: AutogradContext keeps IValues only, and the exchange outlives the graph.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& local, KVExchange* exchange) {
    ctx->saved_data["exchange"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(exchange));
    return exchange->gather(local);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* exchange = reinterpret_cast<KVExchange*>(static_cast<std::intptr_t>(ctx->saved_data["exchange"].toInt()));
    return {exchange->scatter_sum(grads[0].contiguous()), at::Tensor()};
  }
};

}  // namespace

at::Tensor gather_sequence(KVExchange& exchange, const at::Tensor& local) {
  return GatherSequence::apply(local, &exchange);
}

SequenceShard checked_shard(const SequenceShard& shard, std::int64_t rows) {
  TORCH_CHECK(rows == shard.length(), rows, " rows on rank ", shard.rank, " of a sequence-parallel group, whose "
              "shard has ", shard.length(), " positions");
  return shard;
}

at::Tensor shard_positions(const SequenceShard& shard, const at::Tensor& whole, std::int64_t dim) {
  return whole.index_select(dim, at::tensor(shard.positions(), at::kLong).to(whole.device()));
}

std::pair<at::Tensor, at::Tensor> KVExchange::gather_with_graph(const at::Tensor& k, const at::Tensor& v) {
  const auto kv = gather_sequence(*this, at::stack({k, v}));  // [2, B, n_kv, T, hd]
  return {kv[0], kv[1]};
}

at::Tensor shard_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const SequenceShard& shard,
                           const AttentionRule& rule) {
  TORCH_CHECK(q.size(2) == shard.length(), "shard_attention: ", q.size(2), " queries for a shard of ", shard.length(),
              " positions");
  TORCH_CHECK(k.size(2) == shard.seq_len && v.size(2) == shard.seq_len, "shard_attention: K/V of ", k.size(2),
              " positions for a sequence of ", shard.seq_len);
  std::vector<at::Tensor> outs;
  shard.for_each_block([&](const SequenceShard::Block& b, std::int64_t offset) {
    const auto qb = narrow_or_whole(q, 2, offset, b.length());
    const auto kb = narrow_or_whole(k, 2, 0, b.end), vb = narrow_or_whole(v, 2, 0, b.end);
    outs.push_back(rule.packed ? packed_attention(qb, kb, vb, b.start, rule.scale, nullptr, *rule.packed)
                               : prefix_attention(qb, kb, vb, b.start, rule.scale));
  });
  return cat_or_one(outs, 2);
}

}  // namespace sbp
