#include "core/methods/streambp.h"

#include <algorithm>
#include <string>

#include "core/methods/memory_terms.h"
#include "core/model/model.h"

namespace sbp {

using namespace memory;

namespace {

// The worst moment of a chunk of c rows after `prefix` keys in a layer's step 2 (the chunk loop): its MLP backward or
// its attention backward at its largest key block (the most keys with the most rows is a layer's worst chunk).
std::int64_t chunk_moment(const Workload& w, const Sizes& z, std::int64_t c, std::int64_t prefix) {
  const auto& cfg = w.config;
  const auto qw = cfg.q_width(), kw = cfg.kv_width(), I = cfg.intermediate_size;
  // The chunk's saved Q path, per token. Step 2 builds no K/V path (K and V were made without a graph), so
  // attention_activation_bytes_per_token's k (projection, normalised, rotated) and v are not there. Its attention
  // output is the one chunk attention keeps, in the merge dtype (fp32 or wider); in fp32/fp64 that is also o_proj's
  // input (the merge keeps the kernel's [B, c, n_h, hd] layout, so the reshape is a view), in bf16 o_proj saves a
  // bf16 cast of it. Measured with
  //   streambp run --preset tiny{,-mha} --method streambp[:layer_chunk=128,head_chunk=64] --seq 64|256|1024
  //     [--batch 8] [--dtype bf16] --threads 2 --timeline P
  // (the blocks alive at P.csv's peak): the last chunk's graph holds the input norm's normed and scaled outputs, q's
  // projection, normalised and rotated copies, and the attention output (one [c, n_h*hd] block in fp32: B = 8,
  // T = 256, c = 128; an fp32 and a bf16 one in bf16).
  const auto k_path = kw * (cfg.qk_norm ? z.f + (z.lora ? 1 : 2) * z.s : z.s) + kw * z.s;
  const auto o_proj_input = z.f == z.s ? 0 : qw * z.s;
  const auto q_path = attention_activation_bytes_per_token(w, true) - k_path - qw * z.s + qw * z.f + o_proj_input;
  // RoPE's cos and sin of the chunk's c positions for q ([c, hd] each, saved by the rotation; tiny c = 128: two
  // 8 KiB blocks).
  const auto q_rope = rope_table_bytes(w, c) / 2;
  // The chunk's output (the root of its graph, held until grad returns): [B, c, d].
  const auto out = z.B * c * z.d * z.s;
  // The chunk's own weight gradients as autograd makes them (on top of the sums): the MLP's down_proj first; by
  // the attention backward those of the MLP, o_proj and the post norm. Under LoRA only adapters (a few KiB): 0.
  const auto fresh_mlp = z.lora ? 0 : z.d * I * z.g;
  const auto fresh_attention = z.lora ? 0 : (3 * z.d * I + qw * z.d + z.d + (cfg.o_proj_bias ? z.d : 0)) * z.g;
  // MLP backward at its elementwise product's backward: the MLP's saved activations but the product (freed by
  // down_proj's backward), and three [c, I] gradients (of the product and of its two factors). Measured on tiny
  // fp32 at T = 64: 3 saved + 3 gradients [c, I] and down_proj's [d, I] weight gradient alive at the peak.
  const auto mlp_moment = z.B * c * (q_path + mlp_activation_bytes_per_token(w)) + q_rope + out +
                          2 * mlp_backward_bytes(w, z.B * c) + fresh_mlp;
  // Attention backward of the last chunk, at its largest key block (fp32/fp64: the whole prefix at once, then the
  // diagonal block of c keys; bf16: tiles of at most kPrefixTile keys upcast to fp32, with their fp32 copies of K
  // and V, then the diagonal block). Alive beyond the Q path (o_proj's input is freed by then): the chunk's output
  // and h_mid's gradient ([B, c, d] each), the block's dK/dV, the kernel's scratch, and [B, c, n_h*hd] blocks:
  // o_proj's input gradient (model dtype), and in the merge dtype its contiguous copy (the kernel's dO), a copy the
  // kernel makes of that shape, the block's dQ, in bf16 q's fp32 copy, and after the first block the dQ summed so
  // far. Measured on tiny fp32, c = 128, T = 1024 (prefix block of 896 keys): dK, dV of 112 KiB each, four 32 KiB
  // dO/dQ blocks, 256 KiB scratch; bf16: the same plus the 16 KiB bf16 gradient and q's fp32 copy, the K/V tile's
  // fp32 copies (112 KiB each).
  const auto q_rows = z.B * c * qw;
  const auto dq_path = q_rows * (3 * z.f + z.s + (z.f > z.s ? z.f : 0));
  const auto block_gradients = key_blocks_backward_bytes(w, c, prefix);
  const auto attention_moment = z.B * c * (q_path - o_proj_input) + q_rope + 2 * out + fresh_attention +
                                block_gradients + dq_path;
  return std::max(mlp_moment, attention_moment);
}

// A layer's backward over the ring (RingExchange::stream_backward, ARCHITECTURE.md §16), on rank 0 (the longest shard, t
// = z.T, to which every block is padded): the rank's queries (no graph) and their merged outputs and log-sum-exps
// for every chunk at once, its own K/V; the merge recomputed block by block, a block and the one received at a hop
// (from the second hop on, N > 2, the block sent is not yet freed: a hop holds two beside the rank's own);
// each chunk's output backward (o_proj and the MLP, dO out); the blocks round again with their dK/dV sums, at a hop a
// block, its sums and the next ones received, at a block the key-block backward of a chunk; the queries' backward.
std::vector<MemoryEstimate> ring_layer_moments(const Workload& w, const Sizes& z, std::int64_t c,
                                               std::int64_t layer_sums, const std::vector<MemoryTerm>& held) {
  const auto& cfg = w.config;
  const auto qw = cfg.q_width(), kw = cfg.kv_width(), I = cfg.intermediate_size;
  const auto rows = z.B * z.T;
  const auto block = 2 * rows * kw * z.s;  // [2, B, n_kv, t, hd]: K and V of one shard
  const auto sums = 2 * rows * kw * z.f;   // their dK/dV sums (fp32 in bf16)
  const auto N = z.sp;
  const std::vector<MemoryTerm> merged = {{"this rank's queries (no graph)", rows * qw * z.s},
                                          {"their merged outputs and log-sum-exps", rows * (qw + cfg.num_attention_heads) * z.f},
                                          {"this rank's K, V", block}};
  const auto with = [&](std::string moment, std::vector<MemoryTerm> extra) {
    MemoryEstimate e{std::move(moment), held};
    e.terms.insert(e.terms.end(), merged.begin(), merged.end());
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
  const auto dO_dQ = 2 * rows * qw * z.f;
  // A chunk's key-block backward (key_block_backward) at its largest tile: a whole part of another rank's shard (the
  // zig-zag's 2N parts; bf16 tiles of at most 1024 keys, upcast to fp32) or its own causal block of c keys. Beyond
  // its inputs: the tile's dK/dV (and in bf16 its fp32 K/V and q), the block's dQ before it is added, the kernel's
  // scratch.
  const bool upcast = z.f > z.s;
  const auto part = (z.Tg + 2 * N - 1) / (2 * N);
  const auto tile_keys = upcast ? std::min<std::int64_t>(1024, part) : part;
  const auto tile = [&](std::int64_t keys, bool causal) {
    return (upcast ? 4 : 2) * z.B * keys * kw * z.f + (upcast ? 2 : 1) * z.B * c * qw * z.f +
           attention_scratch_bytes(w, compute_dtype(w.dtype), c, keys, causal);
  };
  const auto key_block = std::max(tile(tile_keys, false), tile(c, true));
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
                                    {"dO, dQ of every chunk (but the last dO)", dO_dQ - z.B * c * qw * z.f},
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

}  // namespace

MemoryEstimate StreamBP::memory_model(const Workload& w) const {
  const auto layer_chunk = options_.layer_chunk, head_chunk = options_.head_chunk;
  const Sizes z(w);
  const auto& cfg = w.config;
  const auto btd = z.B * z.T * z.d * z.s;
  const auto kw = cfg.kv_width();
  const auto kv = z.B * z.Tg * kw * z.s;  // one of K, V: [B, n_kv, T, hd] of the whole sequence (gathered under SP)
  // The positions this rank holds, as blocks of the sequence (one process: one block [0, T)); a chunk never crosses
  // a block. Under sequence parallelism rank 0's: its last block ends at T, so its last chunk has the most keys.
  const auto shard = z.sp > 1 ? zigzag_shard(z.Tg, 0, int(z.sp)) : SequenceShard{0, 1, z.T, {{0, z.T}}};
  std::int64_t longest_block = 0, chunks = 0;
  for (const auto& b : shard.blocks) {
    longest_block = std::max(longest_block, b.length());
    chunks += (b.length() + layer_chunk - 1) / layer_chunk;
  }
  const auto c_max = std::min(layer_chunk, longest_block);
  // A layer of one chunk (T <= c) is special: its weight gradients do not exist yet while the chunk is
  // back-propagated (ChunkGradients starts its sums afterwards; tiny fp32 T = 64: 104 KiB the model had too many).
  const bool one_chunk = chunks == 1;
  // Candidates: each block's last chunk (its most keys) and, when that one is short, the full one before it.
  std::int64_t chunk = 0;
  for (const auto& b : shard.blocks) {
    const auto last_start = b.start + (b.length() - 1) / c_max * c_max;
    chunk = std::max(chunk, chunk_moment(w, z, b.end - last_start, last_start));
    if (b.end - last_start < c_max && last_start - c_max >= b.start)
      chunk = std::max(chunk, chunk_moment(w, z, c_max, last_start - c_max));
  }
  // The layer's weight gradients while its chunks run: none yet for a single chunk; else the sums of every chunk so
  // far (the fp32 sums in bf16), without k_proj/v_proj (and k_norm), which only step 3 (kv_path) makes.
  const auto kv_proj_grads = z.lora ? 0 : (2 * z.d * kw + (cfg.attention_bias ? 2 * kw : 0) + (cfg.qk_norm ? cfg.head_dim : 0)) * z.g;
  const auto layer_sums = one_chunk ? 0 : (z.layer_grad - kv_proj_grads) * (z.g < z.f ? z.f / z.g : 1);
  auto moments = streamed_head_moments(w, head_chunk);
  // What a layer's backward holds whatever the K/V scheme
  const auto held_in = [&](const auto& state) -> std::vector<MemoryTerm> {
    return {{"weights", z.weights},
            {"the layer's gathered parameters (ZeRO-3, the whole chunk loop)", z.gathered_layer()},
            {"weight copies (compute dtype)", z.layer_copies()},
            {"gradients (of the head and the layers after)", state.gradients - z.layer_grad},
            {"checkpoints", state.checkpoints},
            {"dL/dH (out, overwritten by in)", btd},
            {"objective buffers", objective_bytes(w)}};
  };
  if (z.sp > 1 && w.sequence_scheme() == SequenceScheme::ring) {
    for (const auto& state : layer_states(z)) {
      for (auto& m : ring_layer_moments(w, z, c_max, layer_sums, held_in(state))) {
        m.moment = "layer " + std::to_string(state.layer) + " " + m.moment;
        moments.push_back(std::move(m));
      }
    }
    return checkpointing_peak(std::move(moments), w);
  }
  for (const auto& state : layer_states(z)) {
    const auto held = held_in(state);
    if (z.sp > 1) {
      // Sequence parallelism (SequenceParallel): the whole sequence's K/V made, then filled piece by piece (at most
      // 4 pieces of [t, hd] slices, a row's K or V of one KV head, padded to the longest shard t) from an all-gather
      // of N pieces (with Gloo's flat copy of them while the collective runs); after the chunk loop this rank's share
      // of dK/dV made, then filled piece by piece from a reduce-scatter of every rank's padded piece packed into one
      // [N, ...] buffer (Gloo all-reduces a clone of it). The layer's sums exist by then.
      const auto piece = slices_per_piece(2 * z.B * cfg.num_key_value_heads) * z.T * cfg.head_dim;
      const auto local = 2 * z.B * shard.length() * kw;  // elements of this rank's K, V (and of its dK/dV share)
      const std::int64_t copies = z.collective_copies ? 2 : 1;  // the backend's copy beside the buffer (NCCL: none)
      MemoryEstimate gather{"layer " + std::to_string(state.layer) + " K/V all-gather", held};
      gather.terms.push_back({"this rank's K, V", local * z.s});
      gather.terms.push_back({"the whole sequence's K, V", 2 * kv, true});
      gather.terms.push_back({"a piece padded", (shard.length() < z.T ? piece : 0) * z.s});
      gather.terms.push_back({"the all-gather's N pieces (and the backend's copy)", copies * z.sp * piece * z.s, true});
      moments.push_back(gather);
      MemoryEstimate scatter{"layer " + std::to_string(state.layer) + " dK/dV reduce-scatter", held};
      scatter.terms.push_back({"layer gradient sums (none for one chunk)", layer_sums});
      for (const auto& t : kv_reduce_scatter_terms(w, z.f)) scatter.terms.push_back(t);
      moments.push_back(scatter);
    }
    moments.push_back({"layer " + std::to_string(state.layer) + " backward",
                       {{"weights", z.weights},
                        {"the layer's gathered parameters (ZeRO-3, the whole chunk loop)", z.gathered_layer()},
                        {"weight copies (compute dtype)", z.layer_copies()},
                        {"gradients (of the head and the layers after)", state.gradients - z.layer_grad},
                        {"layer gradient sums (none for one chunk)", layer_sums},
                        {"checkpoints", state.checkpoints},
                        {"dL/dH (out, overwritten by in)", btd},
                        {"K, V, dK, dV", 2 * kv + 2 * kv * z.f / z.s, true},
                        {"layer chunk", chunk},
                        {"objective buffers", objective_bytes(w)}}});
  }
  return checkpointing_peak(std::move(moments), w);
}

}  // namespace sbp
