#include "core/methods/memory_model.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

#include "core/methods/memory_terms.h"
#include "core/model/chunk_attention_kernels.h"
#include "core/model/model.h"
#include "core/io/input_error.h"

namespace sbp {
namespace memory {
// Per token: the saved input of an RMSNorm in compute dtype (pow/mul keep it), its normalised output and the
// scaled output (kept by the projections that follow) in model dtype.
// Under LoRA the norm weights are frozen: the product with the weight no longer keeps the normalised output.
std::int64_t norm_bytes(std::int64_t width, const Sizes& z) { return width * (z.f + (z.lora ? 1 : 2) * z.s); }
// The final norm feeds only the LM head, which under LoRA is frozen and keeps nothing: only the saved input stays.
// input_kept: the norm's input is a checkpoint (checkpointing's and the streamed heads' H[L]); in fp32/fp64 its saved
// compute-dtype input is that checkpoint itself (`x.to(fp32)` is `x`), counted with the checkpoints already.
// output_held: the caller holds the normed output (the streamed head keeps it for the lm_head's backward), which under
// LoRA no autograd node saves.
std::int64_t final_norm_bytes(std::int64_t width, const Sizes& z, bool input_kept, bool output_held) {
  return (z.lora ? width * (z.f + (output_held ? z.s : 0)) : norm_bytes(width, z)) -
         (input_kept && z.f == z.s ? width * z.f : 0);
}

// Cross-entropy over c positions at its worst moment (log-softmax backward): the saved log-softmax output, the
// gradient coming from nll_loss and the gradient it produces, all [B, c, V] in compute dtype.
std::int64_t loss_peak_bytes(std::int64_t c, const Sizes& z) { return 3 * z.B * c * z.V * z.f; }

// fp32/fp64: the whole prefix at once, then the diagonal block of c keys; bf16: tiles of at most kPrefixTile keys
// upcast to fp32, with their fp32 copies of K and V, then the diagonal block. The kernel runs on fp32 copies of bf16
// blocks: its scratch is the fp32 kernel's (tiny bf16, c = 128: 256 KiB). Where the CPU's bf16 kernel runs
// (Workload::narrow_attention_blocks) the same tiles stay bf16.
std::int64_t key_blocks_backward_bytes(const Workload& w, std::int64_t c, std::int64_t prefix) {
  return key_blocks_backward_bytes(w, w.batch_size, c, prefix);
}
std::int64_t key_blocks_backward_bytes(const Workload& w, std::int64_t rows, std::int64_t c, std::int64_t prefix) {
  const Sizes z(w);
  const auto kw = w.config.kv_width();
  const bool upcast = z.f > z.s;
  const auto key_block = [&](std::int64_t keys, bool after_first, bool diagonal) {
    const auto dq_sum = after_first ? rows * c * w.config.q_width() * z.f : 0;
    if (w.narrow_attention_blocks) {
      // The bf16 kernel (chunk_attention_bf16.cpp): the tile's K/V in bf16 (dense copies) and their fp32 gradients,
      // its workers' scratch (oneDNN's scratchpad in it), and rowsum(dO * O) in fp32. Measured on tiny bf16, B = 1,
      // c = 64, T = 2048 (prefix tile of 1024 keys): 64 KiB K/V copies, 128 KiB dK/dV, 1 KiB rowsum, 640 KiB scratch
      // per worker before the scratchpad.
      const auto& cfg = w.config;
      const auto matrices = rows * cfg.num_key_value_heads;
      const auto group_rows = cfg.num_attention_heads / cfg.num_key_value_heads * c;
      const auto scratch = cpu_bf16_attention_backward_scratch_bytes(matrices, group_rows, keys, cfg.head_dim,
                                                                     diagonal, cfg.attention_scale(), w.threads);
      return rows * keys * kw * 2 * (z.s + z.f) + scratch + rows * cfg.num_attention_heads * c * 4 + dq_sum;
    }
    return (upcast ? 4 : 2) * rows * keys * kw * z.f +
           attention_scratch_bytes(w, compute_dtype(w.dtype), c, keys, diagonal, rows) + dq_sum;
  };
  const auto tile = upcast ? std::min<std::int64_t>(1024, prefix) : prefix;
  return std::max(prefix > 0 ? key_block(tile, tile < prefix, false) : 0, key_block(c, prefix > 0, true));
}

// The hidden states' gradient (dlogits · W, [B·T, d]) and, in full fine-tuning, the weight's (dlogits^T · hn, [V, d]).
// Counted as if both outputs were alive under the larger workspace (autograd runs them one after the other; d(hn) is
// small beside [V, d] where this moment matters). In mixed precision the weight's product (compute dtype) is then
// widened into the fp32 gradient by the cast's backward, the GEMMs' node done: its workspace and the logits' gradient
// gone (native bf16 paths, tiny V = 4096, T = 16: 4% over with the logits' gradient beside the widening). At a short T with a large vocabulary this is the backward's
// peak: the log-softmax moment's [B, T, V] tensors are small there, and a narrow dtype's GEMM workspace can exceed its
// output (tiny V = 4096, T = 16, bf16, standard BP: the meter read 17% above the log-softmax moment).
std::vector<MemoryTerm> head_gemm_terms(const Workload& w) {
  const Sizes z(w);
  const auto rows = z.B * z.T;
  const auto lm_elements = z.lm_grad / z.g;
  auto workspace = gemm_workspace_bytes(w, rows, z.d, z.V, false);
  if (lm_elements > 0) workspace = std::max(workspace, gemm_workspace_bytes(w, z.V, z.d, rows, /*a_transposed=*/true));
  return {{"the GEMMs' outputs: the hidden states' gradient, the lm_head's", (rows * z.d + lm_elements) * z.s},
          {"the logits' gradient (model dtype) and the larger GEMM workspace, or after them the widened lm_head "
           "gradient",
           std::max(rows * z.V * z.s + workspace, z.cast ? lm_elements * z.g : 0)}};
}

// The attention backward's scratch over `queries` x `keys` in `dtype`, from the calibration. On the CPU (ATen's
// FlashAttentionKernel.cpp) it is per thread: the attention weights of a block of queries x keys and their gradient
// in the accumulation dtype (plus a bf16 copy of both for bf16), and whatever the block GEMMs' library takes for
// them, which differs between CPUs: all of it measured by the calibration.
std::int64_t attention_scratch_bytes(const Workload& w, c10::ScalarType dtype, std::int64_t queries, std::int64_t keys,
                                     bool causal, std::int64_t rows) {
  const auto& c = w.config;
  const auto batch = rows > 0 ? rows : w.batch_size;
  return w.workspace_bytes(KernelCall::attention_backward(dtype, w.threads, batch, c.num_attention_heads,
                                                          c.num_key_value_heads, queries, keys, c.head_dim, causal));
}

// A GEMM's workspace in the model dtype, from the calibration (out[m, n] = op(A)[m, k] · op(B)[k, n]).
std::int64_t gemm_workspace_bytes(const Workload& w, std::int64_t m, std::int64_t n, std::int64_t k, bool a_transposed,
                                  bool b_transposed) {
  return w.workspace_bytes(KernelCall::gemm(w.dtype, w.threads, m, n, k, a_transposed, b_transposed));
}

std::int64_t objective_bytes(const Workload& w) { return w.batch_size * w.seq_len * w.objective_bytes_per_token; }

// Checkpoints and gradients alive while layer l is back-propagated: the inputs of layers 0..l, and the gradients of
// the head and of layers l..L-1. Their sum is linear in l, so its largest value is at l = L-1 or l = 0: a method's
// layer moment is evaluated at both.
std::vector<LayerState> layer_states(const Sizes& z) {
  std::vector<LayerState> out;
  for (const auto l : {z.L - 1, std::int64_t(0)}) {
    out.push_back({l, z.checkpoints(l + 1), z.layer_gradients_at(l)});
    if (z.L == 1) break;
  }
  return out;
}

MemoryEstimate largest(std::vector<MemoryEstimate> moments) {
  return *std::max_element(moments.begin(), moments.end(), [](const auto& a, const auto& b) {
    return a.total_bytes() < b.total_bytes();
  });
}

// RoPE's cos and sin tables of `positions` positions ([positions, hd] in the compute dtype), one pair for q and one
// for k, saved by the rotation's multiplications: per position, not per row of the batch. Measured in MsT's
// full-sequence attention re-forward (tiny at B = 1, T = 4096: four 256 KiB blocks the model had missed, 5% of its
// peak; at B = 8, T = 1024 four 64 KiB ones). Standard BP (every layer's tables) and checkpointing (the re-forward's)
// count them too, next to full_sequence_layer_bytes_per_token (measured there: tiny fp32 T = 1024, 64 KiB blocks).
// Packed rows rotate each row at its own positions (Model::rope): [B, 1, positions, hd] tables, one per row.
std::int64_t rope_table_bytes(const Workload& w, std::int64_t positions) {
  return 4 * (w.packed ? w.batch_size : 1) * positions * w.config.head_dim * Sizes(w).s;
}

// RMSNorm's saved statistic rsqrt(mean(x²) + eps): one value per normalised row in the compute dtype, kept by the
// normalising product (and RsqrtBackward) as long as the norm's input needs a gradient. Per token: the layer's input
// and post-attention norms and, with qk_norm, one row per q head and per k head. Measured (run --timeline, tiny fp32
// T = 1024): [T, 1], [T, n_kv] and [T, n_h] rsqrt blocks of 4, 8 and 16 KiB in every layer's saved set.
std::int64_t norm_statistics_bytes_per_token(const Workload& w) {
  const auto& c = w.config;
  return (2 + (c.qk_norm ? c.num_attention_heads + c.num_key_value_heads : 0)) * Sizes(w).f;
}

// What one decoder layer run with a graph on the full sequence keeps for its backward, per token (standard BP's
// forward, checkpointing's re-forward): layer_activation_bytes_per_token and the norm statistics (measured with
// run --timeline, tiny fp32, B = 1, T = 1024, standard and checkpoint: exactly these blocks).
// input_saved = false: the layer's input needs no gradient (standard BP under LoRA, layer 0: the frozen embedding's
// output), so its input norm keeps neither that input nor its statistic; only the scaled output, kept by the adapters'
// A (measured: tiny LoRA fp32 B = 4, T = 256, layer 0 has no [B*T, d] input block and no [B*T, 1] rsqrt).
std::int64_t full_sequence_layer_bytes_per_token(const Workload& w, bool input_kept, bool input_saved) {
  const Sizes z(w);
  const auto input_norm_saved = (input_kept && z.f == z.s ? 0 : z.d * z.f) + z.f;
  return layer_activation_bytes_per_token(w, input_kept) + norm_statistics_bytes_per_token(w) +
         packed_output_copy_bytes_per_token(w) - (input_saved ? 0 : input_norm_saved);
}

// The MLP backward over `tokens` positions holds one [tokens, I] gradient beyond the saved activations at its peak
// (measured on tiny at c = 512: without it StreamBP's model was 6.5-7.3% under the meter, with two 4-5% over).
std::int64_t mlp_backward_bytes(const Workload& w, std::int64_t tokens) {
  return tokens * w.config.intermediate_size * std::int64_t(c10::elementSize(w.dtype));
}

// What SDPA's backward over the full sequence adds (checkpointing, MsT) to the attention block's saved activations
// (the output too: the kernel's backward saved it): the gradients of the attention output, q, k, v and the kernel's
// scratch.
// On packed rows each run's output is freed by its own kernel's backward, which makes that run's dQ: when the last
// run's backward is done, the outputs are gone and every run's dQ, dK, dV are there with the output's gradient.
std::vector<MemoryTerm> attention_backward_terms(const Workload& w) {
  const Sizes z(w);
  const auto& c = w.config;
  return {{w.packed ? "attention gradients (packed: the runs' outputs freed as their dQ is made)"
                    : "attention gradients",
           z.B * z.T * ((w.packed ? 1 : 2) * c.q_width() + 2 * c.kv_width()) * z.s},
          {"attention kernel scratch", whole_sequence_attention_scratch_bytes(w)}};
}

// Embedding backward (Model::embed_backward): rows added in place into the gradient, so only an untied embedding's
// gradient appears here (zeros, then the rows); no dense [V, d] temporary. Under LoRA the embedding is frozen and
// this moment does not happen (an empty estimate).
MemoryEstimate embedding_moment(const Workload& w) {
  const Sizes z(w);
  if (z.lora) return {"embedding backward (none: frozen)", {}};
  return {"embedding backward",
          {{"weights", z.weights}, {"gradients", z.embedding_backward_gradients()}, {"dL/dH", z.B * z.T * z.d * z.s},
           {"objective buffers", objective_bytes(w)}}};
}

// The streamed head (streamed_head, shared by StreamBP and MsT) at its worst moment, and its statistics pass.
std::vector<MemoryEstimate> streamed_head_moments(const Workload& w, std::int64_t head_chunk) {
  const Sizes z(w);
  const auto ch = std::min(head_chunk, z.T);
  const auto btd = z.B * z.T * z.d * z.s;
  // Head chunk: one [B, c_h, V] buffer holds the logits and then, in place, their gradient (plus, for bf16, the
  // model-dtype logits it was cast from and the gradient cast back). The lm_head gradient exists from the first
  // chunk on (that chunk's GEMM creates it while its logits are alive): fp32/fp64 accumulate inside the GEMM (no
  // [V, d] temporary); bf16 sums into fp32, one block of Model::kLmHeadRows rows at a time (its bf16 product and the
  // add's fp32 copy of it), and at the end rounds the sum into the bf16 gradient (the commit moment, after the last
  // chunk's buffers are gone).
  const auto head_logits = z.B * ch * z.V * (z.f + (z.s < z.f ? z.s : 0));
  // dLoss/dh_normed = grad · W ([B, c_h, d]) and its GEMM's workspace (on an AVX512_CORE CPU in bf16 an fp32 copy of
  // the output: 512 KiB at B = 2, c_h = 1024, d = 64).
  const auto grad_hn = z.B * ch * z.d * z.s;
  const auto grad_hn_workspace = gemm_workspace_bytes(w, z.B * ch, z.d, z.V, false);
  // Mixed precision: the gradient is the fp32 sum itself (no commit moment), the GEMMs use a compute-dtype copy of
  // the lm_head.
  const bool blocks = z.f > z.s && z.lm_grad > 0, sums_wider = z.f > z.g && z.lm_grad > 0;
  // A block's product grad^T · h_normed ([rows, d] in the model dtype) with the GEMM's workspace, then the fp32
  // copy of it that the add into the sum makes. fp32/fp64 add inside one GEMM over the whole [V, d] (addmm).
  const auto rows = std::min(Model::kLmHeadRows, z.V);
  const auto lm_block =
      blocks ? rows * z.d * z.s + std::max(gemm_workspace_bytes(w, rows, z.d, z.B * ch, true), rows * z.d * z.f)
      : z.lm_grad > 0 ? gemm_workspace_bytes(w, z.V, z.d, z.B * ch, true)
                      : 0;
  const auto lm_gradient = z.lm_grad * (sums_wider ? z.f / z.g : 1);
  // Every chunk reuses the logits blocks (Model::HeadBuffers), so they are still there while the final norm's
  // backward runs: measured 4 fp32 [B, c_h, d] blocks beyond dLoss/dh_normed (5 under LoRA, whose moment holds less
  // else), on tiny at B = 1, 2 in fp32, fp64 and bf16 (whose norm computes in fp32).
  const auto norm_backward = (z.lora ? 5 : 4) * z.B * ch * z.d * z.f;
  // While the chunk's logits are alive, one after the other: the block-wise lm_head sums (bf16), the GEMM
  // dLoss/dh_normed = grad · W (with the lm_head's compute-dtype copy in mixed precision), the final norm's backward.
  const auto head_work = std::max({lm_block, grad_hn + grad_hn_workspace + z.lm_head_copy(), grad_hn + norm_backward});
  std::vector<MemoryEstimate> moments = {{"head backward",
                                          {{"weights", z.weights},
                                           {"checkpoints", z.checkpoints(z.L + 1)},
                                           {"dL/dH", btd},
                                           {"lm_head gradient", lm_gradient},
                                           {"head chunk", head_logits + z.B * ch * final_norm_bytes(z.d, z, true, true)},
                                           {"head GEMMs or final norm backward", head_work},
                                           {"objective buffers", objective_bytes(w)}}}};
  // The logits GEMM of a later chunk writes into the blocks the earlier chunks left (bf16: its model-dtype product,
  // with whatever the GEMM takes beyond its output, e.g. an fp32 copy of it on an AVX512_CORE CPU).
  moments.push_back({"head forward (logits GEMM)",
                     {{"weights", z.weights},
                      {"checkpoints", z.checkpoints(z.L + 1)},
                      {"dL/dH", btd},
                      {"lm_head gradient", ch < z.T ? lm_gradient : 0},
                      {"head chunk", head_logits + z.B * ch * final_norm_bytes(z.d, z, true, true)},
                      {"the GEMM's workspace (+ the lm_head's compute-dtype copy)",
                       gemm_workspace_bytes(w, z.B * ch, z.V, z.d, false, /*b_transposed=*/true) + z.lm_head_copy()},
                      {"objective buffers", objective_bytes(w)}}});
  if (sums_wider)
    moments.push_back({"lm_head gradient commit",
                       {{"weights", z.weights},
                        {"checkpoints", z.checkpoints(z.L + 1)},
                        {"dL/dH", btd},
                        {"lm_head gradient (fp32 sum + bf16)", z.lm_grad * (z.f + z.g) / z.g},
                        {"objective buffers", objective_bytes(w)}}});
  // DPO's pass 1 (and GRPO's sequence ratio with given old log-probs): logits of one head chunk without a graph.
  if (w.runs_statistics_pass(ch))
    moments.push_back({"statistics pass",
                       {{"weights", z.weights},
                        {"checkpoints", z.checkpoints(z.L + 1)},
                        {"head chunk", z.B * ch * (z.V * z.f + z.d * (z.f + z.s))},
                        {"objective buffers", objective_bytes(w)}}});
  return moments;
}

}  // namespace memory

using namespace memory;

void Workload::add(WorkloadFeature feature) {
  // A feature's place: its kind's index, then (Offload) its kind of state.
  const auto place = [](const WorkloadFeature& f) {
    const auto* offload = std::get_if<Offload>(&f);
    return std::pair{f.index(), offload ? int(offload->kind) : 0};
  };
  std::erase_if(features, [&](const WorkloadFeature& f) { return place(f) == place(feature); });
  const auto at = std::find_if(features.begin(), features.end(),
                               [&](const WorkloadFeature& f) { return place(feature) < place(f); });
  features.insert(at, std::move(feature));
}

void Workload::remove_sequence_parallelism() {
  std::erase_if(features, [](const WorkloadFeature& f) { return std::holds_alternative<SequenceParallelism>(f); });
}

namespace {
template <class Feature>
const Feature* feature_of(const Workload& w) {
  for (const auto& f : w.features)
    if (const auto* found = std::get_if<Feature>(&f)) return found;
  return nullptr;
}
}  // namespace

int Workload::world_size() const {
  const auto* dp = feature_of<DataParallelism>(*this);
  return dp ? dp->world_size : 1;
}

int Workload::zero_stage() const {
  const auto* dp = feature_of<DataParallelism>(*this);
  return dp ? dp->zero_stage : 0;
}

int Workload::sequence_parallel() const {
  const auto* sp = feature_of<SequenceParallelism>(*this);
  return sp ? sp->ranks : 1;
}

SequenceScheme Workload::sequence_scheme() const {
  const auto* sp = feature_of<SequenceParallelism>(*this);
  return sp ? sp->scheme : SequenceScheme::allgather;
}

std::vector<MemoryEstimate> memory::feature_moments(const Workload& w, bool streamed) {
  std::vector<MemoryEstimate> out;
  for_each_feature(w, [&](const auto& f) {
    if constexpr (requires { f.add_moments(w, streamed, out); }) f.add_moments(w, streamed, out);
  });
  return out;
}

void memory::add_feature_step_moments(const Workload& w, StepMoments& step) {
  const Sizes z(w);
  for_each_feature(w, [&](const auto& f) {
    if constexpr (requires { f.add_step_moments(w, z, step); }) f.add_step_moments(w, z, step);
  });
}

std::int64_t Workload::workspace_bytes(const KernelCall& call) const {
  if (!workspaces)
    throw std::logic_error("memory model of " + config.name + ": no kernel calibration attached to the workload (" +
                           call.describe() + ")");
  return workspaces->bytes(call);
}

MemoryEstimate memory::checkpointing_peak(std::vector<MemoryEstimate> moments, const Workload& w) {
  moments.push_back(embedding_moment(w));
  for (auto& m : feature_moments(w, /*streamed=*/true)) moments.push_back(std::move(m));
  auto peak = largest(std::move(moments));
  peak.host = offload_host_terms(w);
  return peak;
}

std::int64_t MemoryEstimate::host_bytes() const {
  std::int64_t sum = 0;
  for (const auto& t : host) sum += t.bytes;
  return sum;
}

std::int64_t MemoryEstimate::total_bytes() const {
  std::int64_t total = 0;
  for (const auto& t : terms) total += t.bytes;
  return total;
}

std::int64_t attention_activation_bytes_per_token(const Workload& w, bool input_kept) {
  const Sizes z(w);
  // The input norm saves its input in compute dtype: in fp32/fp64 that is the layer input itself, free when a
  // checkpoint already keeps it (input_kept: checkpointing, MsT, StreamBP); bf16 saves an fp32 copy.
  const auto input_norm = norm_bytes(w.config.hidden_size, z) - (input_kept && z.f == z.s ? w.config.hidden_size * z.f : 0);
  const auto& c = w.config;
  const auto qw = c.q_width(), kw = c.kv_width();
  // q/k: projection output (the norm's saved input) + normalised + rotated (kept by attention); without qk_norm
  // only the rotated copy stays.
  const auto qk = c.qk_norm ? (qw + kw) * (z.f + (z.lora ? 1 : 2) * z.s) : (qw + kw) * z.s;
  // The attention output is kept once: the kernels write it in q's memory layout ([B, T, n_h, hd]), so
  // Model::attend's transpose + reshape for o_proj is a view and o_proj saves that block itself (measured with
  // run --timeline on tiny fp32 T = 1024, standard and checkpoint: one [T, n_h*hd] block per layer, none from o_proj).
  const auto attention = kw * z.s                      // v (kept by attention)
                         + qw * z.s                    // attention output (o_proj's input)
                         + c.num_attention_heads * 4;  // log-sum-exp rows (fp32)
  // LoRA: each adapted projection keeps A x ([r] per token) for B's backward; x itself is the base's saved input.
  return input_norm + qk + attention + w.lora_attention_targets * w.lora_rank * z.s;
}

std::int64_t mlp_activation_bytes_per_token(const Workload& w) {
  const Sizes z(w);
  // post norm; gate, silu(gate), up, product; A x of each adapted projection
  return norm_bytes(w.config.hidden_size, z) + 4 * w.config.intermediate_size * z.s + w.lora_mlp_targets * w.lora_rank * z.s;
}

std::int64_t layer_activation_bytes_per_token(const Workload& w, bool input_kept) {
  return attention_activation_bytes_per_token(w, input_kept) + mlp_activation_bytes_per_token(w);
}

MemoryEstimate reference_pass_memory(const Workload& w, std::int64_t layer_chunk, std::int64_t head_chunk,
                                     bool separate_weights) {
  const Sizes z(w);
  const auto c = std::min(layer_chunk, z.T), ch = std::min(head_chunk, z.T);
  const auto btd = z.B * z.T * z.d * z.s;
  const auto kv = z.B * z.T * w.config.kv_width() * z.s;
  const auto logps = z.B * z.T * 8;  // the [B, T] fp64 result
  // A chunk without a graph: the normed input, q and its RoPE temporaries, the attention output, the MLP's gate, up
  // and their product.
  const auto chunk = z.B * c * (2 * z.d + 4 * w.config.q_width() + 3 * w.config.intermediate_size) * z.s;
  MemoryEstimate layer{"reference layer",
                       {{"reference weights", separate_weights ? z.P * z.s : 0}, {"hidden states in + out", 2 * btd}, {"K, V", 2 * kv},
                        {"layer chunk", chunk}, {"log-probs", logps}}};
  MemoryEstimate head{"reference head",
                      {{"reference weights", separate_weights ? z.P * z.s : 0}, {"hidden states", btd},
                       {"head chunk", 2 * z.B * ch * z.V * z.f + z.B * ch * norm_bytes(z.d, z)}, {"log-probs", logps}}};
  return largest({layer, head});
}

}  // namespace sbp
