#include "core/methods/streambp.h"

#include <algorithm>
#include <string>

#include "core/methods/memory_terms.h"
#include "core/model/model.h"

namespace sbp {

using namespace memory;

namespace {

// The worst moment of a chunk of c rows in a layer's step 2 (the chunk loop): its MLP backward or its attention
// backward at its largest key block, `block_gradients` (key_blocks_backward_bytes: the most keys with the most rows
// is a layer's worst chunk; on packed rows the largest run's, packed_key_blocks_backward_bytes).
std::int64_t chunk_moment(const Workload& w, const Sizes& z, std::int64_t c, std::int64_t block_gradients) {
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
  // Packed rows in fp32/fp64: the runs' outputs (each saved by its run's attention) are concatenated and transposed for
  // o_proj, a copy o_proj keeps until its backward (bf16 keeps its bf16 cast either way).
  const auto packed_output_copy = w.packed && z.f == z.s ? qw * z.s : 0;
  const auto mlp_moment = z.B * c * (q_path + packed_output_copy + mlp_activation_bytes_per_token(w)) + q_rope + out +
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
  // The CPU's bf16 kernel (Workload::narrow_attention_blocks) takes q and dO in bf16: o_proj's input gradient, its
  // contiguous copy and q's, and the block's fp32 dQ (the same run: three 8 KiB blocks and a 16 KiB one).
  const auto dq_path = w.narrow_attention_blocks ? q_rows * (z.f + 3 * z.s)
                                                 : q_rows * (3 * z.f + z.s + (z.f > z.s ? z.f : 0));
  const auto attention_moment = z.B * c * (q_path - o_proj_input) + q_rope + 2 * out + fresh_attention +
                                block_gradients + dq_path;
  return std::max(mlp_moment, attention_moment);
}

}  // namespace

MemoryEstimate StreamBP::memory_model(const Workload& w) const {
  const auto layer_chunk = options_.layer_chunk, head_chunk = options_.head_chunk;
  const Sizes z(w);
  const auto& cfg = w.config;
  const auto btd = z.B * z.T * z.d * z.s;
  const auto kw = cfg.kv_width();
  // The positions this rank holds, as blocks of the sequence; a chunk never crosses a block.
  const auto shard = rank_shard(z);
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
  if (w.packed) {
    // Packed rows (one process: one block [0, T)): a run's keys are its own sequence's, so the worst chunk is the one
    // whose run has the most (queries, keys), anywhere in the row: every full chunk, then the short last one.
    const auto full_end = z.T / c_max * c_max;
    if (full_end > 0) chunk = chunk_moment(w, z, c_max, packed_key_blocks_backward_bytes(w, c_max, 0, full_end));
    if (full_end < z.T)
      chunk = std::max(chunk, chunk_moment(w, z, z.T - full_end,
                                           packed_key_blocks_backward_bytes(w, c_max, full_end, z.T)));
  } else {
    for (const auto& b : shard.blocks) {
      const auto last_start = b.start + (b.length() - 1) / c_max * c_max;
      const auto last = b.end - last_start;
      chunk = std::max(chunk, chunk_moment(w, z, last, key_blocks_backward_bytes(w, last, last_start)));
      if (last < c_max && last_start - c_max >= b.start)
        chunk = std::max(chunk, chunk_moment(w, z, c_max, key_blocks_backward_bytes(w, c_max, last_start - c_max)));
    }
  }
  // The layer's weight gradients while its chunks run: none yet for a single chunk; else the sums of every chunk so
  // far (the fp32 sums in bf16), without k_proj/v_proj (and k_norm), which only step 3 (kv_path) makes.
  const auto kv_proj_grads = z.lora ? 0 : (2 * z.d * kw + (cfg.attention_bias ? 2 * kw : 0) + (cfg.qk_norm ? cfg.head_dim : 0)) * z.g;
  const auto layer_sums = one_chunk ? 0 : (z.layer_grad - kv_proj_grads) * (z.g < z.f ? z.f / z.g : 1);
  auto moments = streamed_head_moments(w, head_chunk);
  // What a layer's backward holds whatever the K/V source
  const auto held_in = [&](const auto& state) -> std::vector<MemoryTerm> {
    return {{"weights", z.weights},
            {"the layer's gathered parameters (ZeRO-3, the whole chunk loop)", z.gathered_layer()},
            {"weight copies (compute dtype)", z.layer_copies()},
            {"gradients (of the head and the layers after)", state.gradients - z.layer_grad},
            {"checkpoints", state.checkpoints},
            {"dL/dH (out, overwritten by in)", btd},
            {"objective buffers", objective_bytes(w)}};
  };
  // The chunk loop runs through the workload's K/V source, which adds its own terms and moments.
  for (const auto& state : layer_states(z))
    for (auto& m : streamed_layer_moments(w, {"layer " + std::to_string(state.layer), held_in(state), layer_sums,
                                              chunk, c_max}))
      moments.push_back(std::move(m));
  return checkpointing_peak(std::move(moments), w);
}

}  // namespace sbp
