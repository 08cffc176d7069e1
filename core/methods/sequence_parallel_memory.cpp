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
// gradient, the block's dK/dV over its keys (model dtype), its dO/dQ (fp32) and its key blocks' backward. The CPU's
// bf16 kernel (Workload::narrow_attention_blocks) takes dO and q in bf16, as dense copies, and returns dQ in fp32.
std::vector<MemoryTerm> allgather_backward(const Workload& w, const Sizes& z) {
  const auto qw = w.config.q_width();
  const auto last = zigzag_shard(z.Tg, 0, int(z.sp)).blocks.back();
  const auto c = last.length();
  const auto dq_path = w.narrow_attention_blocks ? z.B * c * qw * (z.f + 2 * z.s)
                                                 : z.B * c * qw * (2 * z.f + (z.f > z.s ? z.f : 0));
  return {{"o_proj's input gradient", z.B * z.T * qw * z.s},
          {"the last block's dK, dV (its keys)", 2 * z.B * last.end * w.config.kv_width() * z.s, true},
          {w.narrow_attention_blocks ? "the last block's dQ (fp32) and its dO and q (bf16 copies)"
                                     : "the last block's dO and dQ (fp32), and its q in fp32",
           dq_path},
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

// key_block_backward's arithmetic on a part of `keys` keys for c queries (core/model/chunk_attention.cpp): tiles of
// 32 rows of a KV head's queries by 512 keys, P and dS of one tile ([B, n_kv, 32, 512] each, the compute dtype) and a
// product of a tile ([B, n_kv, 512, hd]); the queries' dQ before it is added; in bf16 the tile's fp32 K and V and
// the queries' and dO's fp32 copies.
std::int64_t ring_tile_backward_bytes(const Workload& w, const Sizes& z, std::int64_t c, std::int64_t keys, bool) {
  const auto& cfg = w.config;
  const bool upcast = z.f > z.s;
  const auto kv = cfg.num_key_value_heads, rows = std::min<std::int64_t>(32, cfg.num_attention_heads / kv * c),
             len = std::min<std::int64_t>(512, keys);
  return 2 * z.B * kv * rows * len * z.f + z.B * len * cfg.kv_width() * z.f + z.B * c * cfg.q_width() * z.f +
         (upcast ? 2 * z.B * len * cfg.kv_width() * z.f + 2 * z.B * c * cfg.q_width() * z.f : 0);
}

// Its largest over the parts a chunk of c queries meets: a whole part of another rank's shard or its own causal block
// of c keys. On packed rows the ring skips a part's keys of sequences that ended before the chunk's earliest query,
// so no part it computes holds more keys than the longest sequence.
std::int64_t ring_key_block_backward_bytes(const Workload& w, const Sizes& z, std::int64_t c) {
  auto part = (z.Tg + 2 * z.sp - 1) / (2 * z.sp);
  if (w.packed) part = std::min(part, w.packed->longest());
  return std::max(ring_tile_backward_bytes(w, z, c, part, false), ring_tile_backward_bytes(w, z, c, c, true));
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
  return {// dQ [B, n_h, t, hd] zeroed; dO is o_proj's input gradient as it comes (the model dtype: no copy of it);
          // rowsum(dO * O) of every row
          {"dQ (merge dtype), and rowsum(dO * O)", z.B * z.T * (qw + w.config.num_attention_heads) * z.f},
          // ring_backward's argument, at::stack of the saved k and v, and its copy padded to the longest shard when this
          // one is shorter (N = 3, T = 1024: 341 and 342 rows): both live until the call returns
          {"this rank's K, V (stacked, and padded)", block * (shard.length() < z.T ? 2 : 1)},
          {"the block in flight (received)", block},
          {"its dK/dV sums (merge dtype)", sums},
          // a part's key_block_backward (ring_tile_backward_bytes); or at a hop the next sums received and, N > 2,
          // the next block (the one sent is not yet freed)
          {"a part's key-block backward, or a hop's next block and sums",
           std::max(ring_key_block_backward_bytes(w, z, c), (z.sp > 2 ? block : 0) + sums)}};
}

// The ring's dK/dV sums travel inside its attention backward: nothing after it.
std::vector<MemoryEstimate> ring_after_backward(const Workload&, const Sizes&, const std::string&,
                                                const std::vector<MemoryTerm>&) {
  return {};
}

// StreamBP's chunk loop over one process's K/V or the all-gather's (the WholeKV sources): the whole sequence's K/V made
// before the loop and their gradient sums (in the merge dtype) through it, beside the layer's worst chunk.
std::vector<MemoryEstimate> whole_kv_streamed(const Workload& w, const Sizes& z, const StreamedLayer& l) {
  const auto kv = z.B * z.Tg * w.config.kv_width() * z.s;  // one of K, V: [B, n_kv, T, hd] of the whole sequence
  MemoryEstimate e{l.layer + " backward", l.held};
  e.terms.insert(e.terms.end(), {{"layer gradient sums (none for one chunk)", l.sums},
                                 {"K, V, dK, dV", 2 * kv + 2 * kv * z.f / z.s, true},
                                 {"layer chunk", l.chunk}});
  return {e};
}

// The all-gather (SequenceParallel) around that loop: the whole sequence's K/V made, then filled piece by piece (at
// most 4 pieces of [t, hd] slices, a row's K or V of one KV head, padded to the longest shard t) from an all-gather of
// N pieces (with Gloo's flat copy of them while the collective runs); after the chunk loop this rank's share of dK/dV
// made, then filled piece by piece from a reduce-scatter of every rank's padded piece packed into one [N, ...] buffer
// (Gloo all-reduces a clone of it). The layer's sums exist by then.
std::vector<MemoryEstimate> allgather_streamed(const Workload& w, const Sizes& z, const StreamedLayer& l) {
  const auto& cfg = w.config;
  const auto kv = z.B * z.Tg * cfg.kv_width() * z.s;
  const auto piece = slices_per_piece(2 * z.B * cfg.num_key_value_heads) * z.T * cfg.head_dim;
  const auto shard = zigzag_shard(z.Tg, 0, int(z.sp));
  const auto local = 2 * z.B * shard.length() * cfg.kv_width();  // elements of this rank's K, V (and dK/dV share)
  const std::int64_t copies = z.collective_copies ? 2 : 1;  // the backend's copy beside the buffer (NCCL: none)
  MemoryEstimate gather{l.layer + " K/V all-gather", l.held};
  gather.terms.insert(gather.terms.end(),
                      {{"this rank's K, V", local * z.s},
                       {"the whole sequence's K, V", 2 * kv, true},
                       {"a piece padded", (shard.length() < z.T ? piece : 0) * z.s},
                       {"the all-gather's N pieces (and the backend's copy)", copies * z.sp * piece * z.s, true}});
  MemoryEstimate scatter{l.layer + " dK/dV reduce-scatter", l.held};
  scatter.terms.push_back({"layer gradient sums (none for one chunk)", l.sums});
  for (const auto& t : kv_reduce_scatter_terms(w, z.f)) scatter.terms.push_back(t);
  auto out = whole_kv_streamed(w, z, l);
  out.insert(out.begin(), {gather, scatter});
  return out;
}

// A layer's backward over the ring (RingExchange::stream_backward, ARCHITECTURE.md §16), on rank 0 (the longest shard, t
// = z.T, to which every block is padded): the rank's queries (no graph) and their merged outputs and log-sum-exps
// for every chunk at once (the outputs until each chunk's dO exists, then rowsum(dO * O) instead), its own K/V; the merge recomputed block by block, a block and the one received at a hop
// (from the second hop on, N > 2, the block sent is not yet freed: a hop holds two beside the rank's own);
// each chunk's output backward (o_proj and the MLP, dO out); the blocks round again with their dK/dV sums, at a hop a
// block, its sums and the next ones received, at a block the key-block backward of a chunk; the queries' backward.
std::vector<MemoryEstimate> ring_streamed(const Workload& w, const Sizes& z, const StreamedLayer& l) {
  const auto c = l.c;
  const auto layer_sums = l.sums;
  const auto& held = l.held;
  const auto& cfg = w.config;
  const auto qw = cfg.q_width(), kw = cfg.kv_width(), I = cfg.intermediate_size;
  const auto rows = z.B * z.T;
  const auto block = 2 * rows * kw * z.s;  // [2, B, n_kv, t, hd]: K and V of one shard
  const auto sums = 2 * rows * kw * z.f;   // their dK/dV sums (fp32 in bf16)
  const auto N = z.sp;
  // Until a chunk's dO exists its merged output is held; then only rowsum(dO * O) beside the log-sum-exp.
  const auto row_terms = rows * 2 * cfg.num_attention_heads * z.f;
  const std::vector<MemoryTerm> merged = {{"this rank's queries (no graph)", rows * qw * z.s},
                                          {"their merged outputs and log-sum-exps", rows * (qw + cfg.num_attention_heads) * z.f},
                                          {"this rank's K, V", block}};
  const std::vector<MemoryTerm> reduced = {{"this rank's queries (no graph)", rows * qw * z.s},
                                           {"their log-sum-exps and rowsum(dO * O)", row_terms},
                                           {"this rank's K, V", block}};
  const auto with = [&](std::string moment, std::vector<MemoryTerm> extra) {
    MemoryEstimate e{l.layer + " " + moment, held};
    const bool merging = moment.find("merge") != std::string::npos;
    e.terms.insert(e.terms.end(), merging ? merged.begin() : reduced.begin(), merging ? merged.end() : reduced.end());
    e.terms.insert(e.terms.end(), extra.begin(), extra.end());
    return e;
  };
  // The last chunk's output backward at its MLP's elementwise product (as chunk_moment's MLP moment): the MLP's saved
  // activations but the product, the chunk's output, three [c, I] gradients, down_proj's weight gradient; o_proj's
  // input is a view of the merged output. Every chunk's dQ (zeros) exists, every dO but the last chunk's.
  const auto out = z.B * c * z.d * z.s;
  const auto fresh_mlp = z.lora ? 0 : z.d * I * z.g;
  const auto output_chunk = z.B * c * (mlp_activation_bytes_per_token(w) - I * z.s) + out +
                            2 * mlp_backward_bytes(w, z.B * c) + fresh_mlp;
  // Every chunk's dQ in the merge dtype, its dO in the model dtype (ring_exchange.cpp: bf16 dO holds bf16 values).
  const auto dO_dQ = rows * qw * (z.f + z.s);
  // A chunk's key-block backward (key_block_backward) at its largest tile (ring_key_block_backward_bytes).
  const bool upcast = z.f > z.s;
  const auto key_block = ring_key_block_backward_bytes(w, z, c);
  // A chunk's merge of one tile (merge_key_block), in the merge dtype: the tile's output and the two rescaled outputs
  // beside the old and the new merged one (in bf16 also q's fp32 copy), and six [c, n_h] log-sum-exp steps.
  const auto merge_step = z.B * c * (qw * (upcast ? 5 : 4) + 6 * cfg.num_attention_heads) * z.f;
  // A chunk's queries' backward (StreamedBackward::q_backward: RoPE, q_norm, q_proj, the input norm): seven [c, d]
  // gradients and saved values in the merge dtype, the normed input and its q projection in the model dtype (LoRA:
  // the projection only), in bf16 their fp32 copies, the RoPE table of its positions. Measured with the meter's
  // timeline (tiny, N = 2 and 3, T = 512 and 2048, fp64 and bf16, with and without LoRA).
  const auto q_chunk = z.B * c * (7 * z.d * z.f + ((z.lora ? 1 : 2) + (upcast ? 2 : 0)) * z.d * z.s + z.f) +
                       rope_table_bytes(w, c) / 2;
  // The output backward's MLP GEMMs: their workspace (the input gradient's, and down_proj's weight gradient's in full
  // fine-tuning), as a chunk's in one process.
  const auto out_gemm = std::max(gemm_workspace_bytes(w, z.B * c, I, z.d, false),
                                  z.lora ? 0 : gemm_workspace_bytes(w, z.d, I, z.B * c, true));
  return {
      with("ring merge (recomputed)", {{"the block in flight (received)", (N > 2 ? 2 : 1) * block}}),
      with("ring merge of a chunk", {{"the block received", N > 1 ? block : 0}, {"a chunk's merge step", merge_step}}),
      with("ring output backward", {{"layer gradient sums (none for one chunk)", layer_sums},
                                    {"dO, dQ of every chunk (but the last dO)", dO_dQ - z.B * c * qw * z.s},
                                    {"the last chunk's merged output", z.B * c * qw * z.f},
                                    {"a chunk's output backward", output_chunk + out_gemm}}),
      with("ring key-block backward", {{"layer gradient sums (none for one chunk)", layer_sums},
                                       {"dO, dQ of every chunk", dO_dQ},
                                       {"the block received", block},
                                       {"its dK/dV sums", sums},
                                       {"a key tile's backward", key_block}}),
      with("ring queries' backward", {{"layer gradient sums (none for one chunk)", layer_sums},
                                      {"dO, dQ of every chunk", dO_dQ},
                                      {"the dK/dV sums home", sums},
                                      {"a chunk's queries' backward", q_chunk}}),
      with("ring dK/dV hop", {{"layer gradient sums (none for one chunk)", layer_sums},
                              {"dO, dQ of every chunk", dO_dQ},
                              {"the block in flight (received)", (N > 2 ? 2 : 1) * block},
                              {"its dK/dV sums and the next received", 2 * sums}}),
  };
}

struct ExchangeModel {
  ShardAttention (*attention)(const Workload&, const Sizes&);
  std::vector<MemoryTerm> (*backward)(const Workload&, const Sizes&);
  std::vector<MemoryEstimate> (*after_backward)(const Workload&, const Sizes&, const std::string&,
                                                const std::vector<MemoryTerm>&);
  std::vector<MemoryEstimate> (*streamed)(const Workload&, const Sizes&, const StreamedLayer&);
};

// The one place the scheme selects its terms.
const ExchangeModel& exchange_model(const Workload& w) {
  static const ExchangeModel allgather{allgather_attention, allgather_backward, allgather_after_backward,
                                       allgather_streamed};
  static const ExchangeModel ring{ring_attention, ring_backward_terms, ring_after_backward, ring_streamed};
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

std::vector<MemoryEstimate> streamed_layer_moments(const Workload& w, const StreamedLayer& layer) {
  const Sizes z(w);
  return z.sp == 1 ? whole_kv_streamed(w, z, layer) : exchange_model(w).streamed(w, z, layer);
}

SequenceShard rank_shard(const Sizes& z) {
  return z.sp > 1 ? zigzag_shard(z.Tg, 0, int(z.sp)) : SequenceShard{0, 1, z.T, {{0, z.T}}};
}

}  // namespace memory
}  // namespace sbp
