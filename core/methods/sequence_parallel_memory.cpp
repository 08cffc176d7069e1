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

// The K/V exchanges of Model::attention_block (--sp-scheme), each as the terms below; exchange_model picks one.
namespace {

// Per layer: Model::attention_block projects each block of the shard, rotates its q and K at their global positions,
// all-gathers the K/V (the rotated K and V feed the exchange, and only the gathered whole is kept) and attends the
// block's queries over the keys before its end: block 0 of rank 0 through SDPA (output in the model dtype), the others
// through PrefixAndDiagonal (its merged output in the merge dtype, >= fp32). o_proj's input is their concatenation.
ShardAttention allgather_attention(const Workload& w, const Sizes& z) {
  const auto kw = w.config.kv_width(), qw = w.config.q_width();
  std::int64_t outputs = 0;
  for (const auto& b : zigzag_shard(z.Tg, 0, int(z.sp)).blocks) outputs += b.length() * (b.start == 0 ? z.s : z.f);
  return {2 * z.B * z.Tg * kw * z.s, z.B * (qw * outputs - 2 * z.T * kw * z.s)};
}

// The attention backward of the shard's last block (the most keys), as the baselines' graphs run it: o_proj's input
// gradient, the block's dK/dV over its keys (model dtype), its dO/dQ (fp32) and its key blocks' backward.
std::vector<MemoryTerm> allgather_backward(const Workload& w, const Sizes& z) {
  const auto qw = w.config.q_width();
  const auto last = zigzag_shard(z.Tg, 0, int(z.sp)).blocks.back();
  const auto c = last.length();
  return {{"o_proj's input gradient", z.B * z.T * qw * z.s},
          {"the last block's dK, dV (its keys)", 2 * z.B * last.end * w.config.kv_width() * z.s, true},
          {"the last block's dO and dQ (fp32), and its q in fp32", z.B * c * qw * (2 * z.f + (z.f > z.s ? z.f : 0))},
          {"the last block's key blocks' backward", key_blocks_backward_bytes(w, c, last.start)}};
}

// After the blocks' attention backward: their saved q, K/V and outputs are released, and o_proj's input with o_proj's
// backward; the whole sequence's K and V gradients become the gathered tensor's (select's backward pads each into a
// zeroed [2, B, n_kv, T, hd]: dK, dV and two of those at once, 2.5 times the gathered K/V), which the exchange then
// reduce-scatters piece by piece into this rank's share.
std::vector<MemoryEstimate> allgather_after_backward(const Workload& w, const Sizes& z, const std::string& layer,
                                                     const std::vector<MemoryTerm>& held) {
  const auto& c = w.config;
  const auto whole_kv = allgather_attention(w, z).whole_kv;
  const MemoryTerm kept{"attention activations but q, K, V and the outputs",
                        z.B * z.T * (attention_activation_bytes_per_token(w, true) - 2 * c.q_width() * z.s) -
                            2 * z.B * z.T * c.kv_width() * z.s};
  MemoryEstimate select{layer + " (K/V gradients)", held};
  select.terms.insert(select.terms.end(),
                      {kept,
                       {"q's gradient", z.B * z.T * c.q_width() * z.s},
                       {"dK, dV and select's zero-padded copies (whole sequence)", 5 * whole_kv / 2, true}});
  MemoryEstimate scatter{layer + " (dK/dV reduce-scatter)", held};
  scatter.terms.push_back(kept);
  for (const auto& t : kv_reduce_scatter_terms(w, z.s)) scatter.terms.push_back(t);
  return {select, scatter};
}

// The ring (RingAttention in core/training/ring_exchange.cpp): the rank's own rotated K and V stay (saved, as one
// process's attention keeps them); its merged output, in the merge dtype, is saved beside o_proj's input (a transposed
// copy of it), and so are the log-sum-exps, in the merge dtype where one process's kernel keeps fp32 (tiny-mha fp64,
// T = 1024, N = 2, checkpoint: a [B, n_h, t, hd] and a [B, n_h, t] fp64 block beside one process's).
ShardAttention ring_attention(const Workload& w, const Sizes& z) {
  const auto& c = w.config;
  return {0, z.B * z.T * (c.q_width() * z.f + c.num_attention_heads * (z.f - 4))};
}

// RingAttention's backward (ring_backward), rank 0 after the first hop: at a part's key-block backward, or at a hop.
// Measured with the meter's timeline (tiny-mha fp64, T = 1024, N = 2 and 3, checkpoint; blocks by size and order).
std::vector<MemoryTerm> ring_backward_terms(const Workload& w, const Sizes& z) {
  const auto qw = w.config.q_width(), kw = w.config.kv_width();
  const auto block = 2 * z.B * z.T * kw * z.s;  // [2, B, n_kv, t, hd]: K and V of one shard (the longest)
  const auto sums = 2 * z.B * z.T * kw * z.f;   // their dK/dV sums
  const auto shard = zigzag_shard(z.Tg, 0, int(z.sp));
  const auto c = shard.blocks.back().length();  // a part of the zig-zag shard: its queries, a block's most keys
  // o_proj's input gradient ([B, t, n_h*hd]) takes the place of o_proj's input, the merged output's transposed copy
  // that o_proj's backward frees (the activations count it).
  return {// dQ [B, n_h, t, hd] zeroed, and dO cast to it when the model dtype is narrower (else dO is o_proj's gradient)
          {"dQ, and dO when cast (merge dtype)", z.B * z.T * qw * z.f * (z.f > z.s ? 2 : 1)},
          // ring_backward's argument, at::stack of the saved k and v, and its copy padded to the longest shard when this
          // one is shorter (N = 3, T = 1024: 341 and 342 rows): both live until the call returns
          {"this rank's K, V (stacked, and padded)", block * (shard.length() < z.T ? 2 : 1)},
          {"the block in flight (received)", block},
          {"its dK/dV sums (merge dtype)", sums},
          // the kernel's dQ, dK, dV of one part, its scratch and a contiguous copy of the part's dO; or at a hop the
          // next sums received and, N > 2, the next block (the one sent is not yet freed)
          {"a part's key-block backward, or a hop's next block and sums",
           std::max(key_blocks_backward_bytes(w, c, c) + z.B * c * qw * z.f, (z.sp > 2 ? block : 0) + sums)}};
}

// The ring's dK/dV sums travel inside its attention backward: nothing after it.
std::vector<MemoryEstimate> ring_after_backward(const Workload&, const Sizes&, const std::string&,
                                                const std::vector<MemoryTerm>&) {
  return {};
}

struct ExchangeModel {
  ShardAttention (*attention)(const Workload&, const Sizes&);
  std::vector<MemoryTerm> (*backward)(const Workload&, const Sizes&);
  std::vector<MemoryEstimate> (*after_backward)(const Workload&, const Sizes&, const std::string&,
                                                const std::vector<MemoryTerm>&);
};

// The one place the scheme selects its terms.
const ExchangeModel& exchange_model(const Workload& w) {
  static const ExchangeModel allgather{allgather_attention, allgather_backward, allgather_after_backward};
  static const ExchangeModel ring{ring_attention, ring_backward_terms, ring_after_backward};
  return w.sequence_scheme() == SequenceScheme::ring ? ring : allgather;
}

}  // namespace

ShardAttention shard_attention_bytes(const Workload& w) {
  const Sizes z(w);
  return z.sp == 1 ? ShardAttention{} : exchange_model(w).attention(w, z);
}

std::vector<MemoryTerm> shard_attention_backward_terms(const Workload& w) {
  const Sizes z(w);
  return z.sp == 1 ? attention_backward_terms(w) : exchange_model(w).backward(w, z);
}

std::vector<MemoryEstimate> kv_exchange_backward_moments(const Workload& w, const std::string& layer,
                                                         const std::vector<MemoryTerm>& held) {
  const Sizes z(w);
  if (z.sp == 1) return {};
  return exchange_model(w).after_backward(w, z, layer, held);
}

}  // namespace memory
}  // namespace sbp
