// What sequence parallelism adds to the memory models (ARCHITECTURE.md §16): SequenceParallelism's size (this rank's
// positions, the longest shard's), and the terms the methods that run on a shard write their moments with.
#include <algorithm>
#include <string>
#include <vector>

#include "core/methods/memory_terms.h"

namespace sbp {

void SequenceParallelism::size(memory::Sizes& z) const {
  z.sp = ranks;
  if (ranks > 1) z.T = longest_zigzag_shard(z.Tg, ranks);
}

namespace memory {

void require_whole_sequences(const Workload& w, const std::string& method) {
  if (w.sequence_parallel() > 1)
    throw InputError("the memory model of " + method + " does not cover sequence parallelism (the method "
                                "does not run on a shard); no estimate for a sequence split over " +
                                std::to_string(w.sequence_parallel()) + " ranks");
}

std::vector<MemoryTerm> shard_attention_backward_terms(const Workload& w) {
  const Sizes z(w);
  const auto qw = w.config.q_width();
  const auto last = zigzag_shard(z.Tg, 0, int(z.sp)).blocks.back();
  const auto c = last.length();
  return {{"o_proj's input gradient", z.B * z.T * qw * z.s},
          {"the last block's dK, dV (its keys)", 2 * z.B * last.end * w.config.kv_width() * z.s, true},
          {"the last block's dO and dQ (fp32), and its q in fp32", z.B * c * qw * (2 * z.f + (z.f > z.s ? z.f : 0))},
          {"the last block's key blocks' backward", key_blocks_backward_bytes(w, c, last.start)}};
}

std::vector<MemoryTerm> kv_reduce_scatter_terms(const Workload& w, std::int64_t element_bytes) {
  const Sizes z(w);
  const auto& cfg = w.config;
  const auto piece = slices_per_piece(2 * z.B * cfg.num_key_value_heads) * z.T * cfg.head_dim;
  const std::int64_t copies = z.collective_copies ? 2 : 1;  // the backend's copy beside the buffer (NCCL: none)
  return {{"dK, dV (whole sequence)", 2 * z.B * z.Tg * cfg.kv_width() * element_bytes, true},
          {"this rank's share of them", 2 * z.B * z.T * cfg.kv_width() * element_bytes},
          {"every rank's padded piece (and the backend's clone)", copies * z.sp * piece * element_bytes, true},
          {"the piece summed", piece * element_bytes}};
}

// In the forward, the [B, t, V] logits stay alive while each block's loss is made: the saved log-softmax outputs of
// the blocks so far and the block's own temporary ([B, len, V]). In the backward, which takes the blocks last first,
// while block k's log-softmax is back-propagated: the logits' gradient summed so far ([B, t, V], made by the first
// block's narrow backward), the saved outputs of the blocks before k, and block k's own (saved, incoming, produced:
// 3 [B, len, V]); then its narrow backward pads the produced gradient to a [B, t, V] of zeros, added into the sum.
// (One process: 3 [B, T, V] both ways.)
std::int64_t shard_loss_peak_bytes(const Workload& w) {
  const Sizes z(w);
  if (z.sp == 1) return loss_peak_bytes(z.T, z);
  const auto shard = zigzag_shard(z.Tg, 0, int(z.sp));
  const auto n = shard.blocks.size();
  std::int64_t before = z.T, peak = 0;  // positions of the blocks before k
  for (std::size_t k = n; k-- > 0;) {
    const auto len = shard.blocks[k].length();
    before -= len;
    const auto sum = k + 1 < n ? z.T : 0;
    peak = std::max({peak, z.T + before + 2 * len, sum + before + 3 * len, sum + before + len + z.T});
  }
  return z.B * peak * z.V * z.f;
}

// Per layer: Model::attention_block projects each block of the shard, rotates its q and K at their global positions,
// all-gathers the K/V (the rotated K and V feed the exchange, and only the gathered whole is kept) and attends the
// block's queries over the keys before its end: block 0 of rank 0 through SDPA (output in the model dtype), the others
// through PrefixAndDiagonal (its merged output in the merge dtype, >= fp32). o_proj's input is their concatenation.
ShardAttention shard_attention_bytes(const Workload& w) {
  const Sizes z(w);
  if (z.sp == 1) return {};
  const auto kw = w.config.kv_width(), qw = w.config.q_width();
  std::int64_t outputs = 0;
  for (const auto& b : zigzag_shard(z.Tg, 0, int(z.sp)).blocks) outputs += b.length() * (b.start == 0 ? z.s : z.f);
  return {2 * z.B * z.Tg * kw * z.s, z.B * (qw * outputs - 2 * z.T * kw * z.s)};
}

}  // namespace memory
}  // namespace sbp
