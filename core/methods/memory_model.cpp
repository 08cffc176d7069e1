#include "core/methods/memory_model.h"

#include <algorithm>
#include <string>

#include "core/io/dtype.h"
#include "core/model/model.h"

namespace sbp {
namespace {

struct Sizes {
  std::int64_t s, f, g;             // bytes per element: model (compute) dtype, its statistics dtype, gradients
  std::int64_t B, T, d, V, L, P;
  bool lora;
  std::int64_t weights;          // base + adapters (the trainable ones in the gradient dtype: fp32 masters)
  std::int64_t lm_grad;          // the lm_head/embedding gradient [V, d] (none under LoRA: frozen)
  std::int64_t all_gradients;    // every trainable tensor's gradient
  std::int64_t layer_gradients;  // every gradient that exists while the layers are back-propagated (at layer 0)
  std::int64_t head_gradients;   // what the head leaves: lm_head (tied: the embedding's) and final norm gradients
  std::int64_t layer_grad;       // one decoder layer's gradients (its adapters' under LoRA)
  // Mixed precision (g > s): a trainable master is cast to the compute dtype where it is used, and a graph keeps
  // that copy (linear saves its weight): cast bytes per trainable element, 0 when the masters are the weights.
  std::int64_t cast;
  explicit Sizes(const Workload& w)
      : s(std::int64_t(c10::elementSize(w.dtype))),
        f(std::int64_t(c10::elementSize(compute_dtype(w.dtype)))),
        g(std::int64_t(c10::elementSize(w.gradient_dtype()))),
        B(w.batch_size), T(w.seq_len), d(w.config.hidden_size), V(w.config.vocab_size),
        L(w.config.num_hidden_layers), P(w.config.num_parameters()), lora(w.lora_rank > 0),
        weights(lora ? P * s + w.lora_parameters * g : P * g), lm_grad(lora ? 0 : V * d * g),
        all_gradients(lora ? w.lora_parameters * g : P * g),
        // Full fine-tuning: all but an untied embedding's, which only the embedding backward writes.
        layer_gradients(lora ? w.lora_parameters * g : P * g - (w.config.tie_word_embeddings ? 0 : V * d * g)),
        head_gradients(lora ? 0 : (V + 1) * d * g),
        layer_grad(lora ? w.lora_parameters * g / std::max<std::int64_t>(1, L)
                        : (P - (w.config.tie_word_embeddings ? 1 : 2) * V * d - d) * g / std::max<std::int64_t>(1, L)),
        cast(g > s ? s : 0), N(w.world_size), stage(w.zero_stage), tied(w.config.tie_word_embeddings),
        head_group(lora ? 0 : tied ? d * g : (V + 1) * d * g), embedding_group(lm_grad),
        largest_tensor(lora ? std::min(w.lora_parameters, w.lora_rank * std::max({w.config.intermediate_size, d,
                                                                                  w.config.q_width()}))
                            : V * d) {
    // ZeRO-3: the trainable tensors are this rank's slices, the embedding and head gathered for the whole step (the
    // BP's "weights"), a layer's only while it is in use (gathered_layer), none but the slices between steps.
    rest_weights = weights;
    if (sharded_parameters()) {
      rest_weights = weights - all_gradients + slice_elements(all_gradients) * g;  // trainable bytes = gradient bytes
      weights = rest_weights + embedding_group + head_group;
    }
  }
  // Compute-dtype copies of the trainable tensors a graph keeps (0 unless mixed precision).
  std::int64_t layer_copies() const { return layer_grad / g * cast; }
  std::int64_t lm_head_copy() const { return lm_grad / g * cast; }
  std::int64_t all_copies() const { return layer_gradients / g * cast; }  // every layer's and the lm_head's

  // Data parallelism (ARCHITECTURE.md §12), this rank's share. The gradient groups, in event order: the head (final norm; an
  // untied lm_head), every layer from the last, the embedding (tied: the lm_head's gradient too, which exists from the
  // head backward on). Under LoRA only the layers' adapters are trainable: the head and embedding have no event.
  std::int64_t N;
  int stage;
  bool tied;
  std::int64_t head_group, embedding_group;  // gradient bytes of the head's and the embedding's groups
  std::int64_t largest_tensor;               // elements of the largest trainable tensor (the [V, d] embedding)
  bool sharded_gradients() const { return N > 1 && stage >= 2; }
  bool sharded_parameters() const { return N > 1 && stage >= 3; }
  // The weights held between steps (ZeRO-3: the frozen base and the trainable slices; else `weights`).
  std::int64_t rest_weights = 0;
  // ZeRO-3: a decoder layer's trainable tensors gathered in full while it is in use (its forward; its backward, the
  // whole chunk loop for StreamBP), beside its slices: "one layer of extra memory".
  std::int64_t gathered_layer() const { return sharded_parameters() ? layer_grad : 0; }
  // ZeRO-3's gather of a group of `bytes` (DataParallel::use): this rank's [slice] packed and the [N, slice] gathered
  // (with the backend's copy while it runs), then the full tensors made from it while it is alive.
  std::int64_t gather_buffers(std::int64_t bytes, bool copies) const {
    const auto slice = slice_elements(bytes) * g;
    return std::max((N + 1 + (copies ? N : 0)) * slice, N * slice + bytes);
  }
  // Elements of this rank's slices of a group of `bytes` gradient bytes: ceil(numel / N) of every tensor (rank 0's,
  // the longest). Counted on the group as a whole: each tensor's padding (< N elements) is left out.
  std::int64_t slice_elements(std::int64_t bytes) const { return (bytes / g + N - 1) / N; }
  // What a group's gradients occupy once reduced: all of them (stages 0-1), or this rank's slice (stage 2).
  std::int64_t reduced(std::int64_t bytes) const { return sharded_gradients() ? slice_elements(bytes) * g : bytes; }
  // Gradients alive after the head's event (the head_gradients of one process).
  std::int64_t head_after() const {
    return sharded_gradients() ? reduced(head_group) + (tied ? lm_grad : 0) : head_gradients;
  }
  // Gradients alive while layer l is back-propagated: the head's and the layers' after l (reduced) and layer l's own.
  std::int64_t layer_gradients_at(std::int64_t l) const {
    return sharded_gradients() ? head_after() + (L - 1 - l) * reduced(layer_grad) + layer_grad
                               : head_gradients + (L - l) * layer_grad;
  }
  // Gradients alive in the embedding backward, before its event: every other group's reduced, the embedding's full.
  std::int64_t embedding_backward_gradients() const {
    return sharded_gradients() ? head_after() + L * reduced(layer_grad) + (tied ? 0 : embedding_group) : all_gradients;
  }
  // Gradients the optimizer step sees: every group's reduced.
  std::int64_t step_gradients() const {
    return sharded_gradients() ? reduced(head_group) + L * reduced(layer_grad) + reduced(embedding_group)
                               : all_gradients;
  }
  // What a group's collective allocates at its event: stages 0-1 all-reduce a flat copy of its gradients (at::cat);
  // stage 2 packs them into a zeroed [N, slice] buffer and reduce-scatters it into the [slice] it keeps, the backend
  // holding one more copy of the buffer meanwhile (collective_copies).
  std::int64_t reduction_buffers(std::int64_t bytes, bool copies) const {
    if (!sharded_gradients()) return bytes;
    return (N + 1 + (copies ? N : 0)) * slice_elements(bytes) * g;
  }
};

// Per token: the saved input of an RMSNorm in compute dtype (pow/mul keep it), its normalised output and the
// scaled output (kept by the projections that follow) in model dtype.
// Under LoRA the norm weights are frozen: the product with the weight no longer keeps the normalised output.
std::int64_t norm_bytes(std::int64_t width, const Sizes& z) { return width * (z.f + (z.lora ? 1 : 2) * z.s); }
// The final norm feeds only the LM head, which under LoRA is frozen and keeps nothing: only the saved input stays.
// input_kept: the norm's input is a checkpoint (checkpointing's and the streamed heads' H[L]); in fp32/fp64 its saved
// compute-dtype input is that checkpoint itself (`x.to(fp32)` is `x`), counted with the checkpoints already.
// output_held: the caller holds the normed output (the streamed head keeps it for the lm_head's backward), which under
// LoRA no autograd node saves.
std::int64_t final_norm_bytes(std::int64_t width, const Sizes& z, bool input_kept, bool output_held = false) {
  return (z.lora ? width * (z.f + (output_held ? z.s : 0)) : norm_bytes(width, z)) -
         (input_kept && z.f == z.s ? width * z.f : 0);
}

// Cross-entropy over c positions at its worst moment (log-softmax backward): the saved log-softmax output, the
// gradient coming from nll_loss and the gradient it produces, all [B, c, V] in compute dtype.
std::int64_t loss_peak_bytes(std::int64_t c, const Sizes& z) { return 3 * z.B * c * z.V * z.f; }

// The attention backward's scratch over `queries` x `keys` in `dtype`, from the calibration. On the CPU (ATen's
// FlashAttentionKernel.cpp) it is per thread: the attention weights of a block of queries x keys and their gradient
// in the accumulation dtype (plus a bf16 copy of both for bf16), and whatever the block GEMMs' library takes for
// them, which differs between CPUs: all of it measured by the calibration.
std::int64_t attention_scratch_bytes(const Workload& w, c10::ScalarType dtype, std::int64_t queries, std::int64_t keys,
                                     bool causal) {
  const auto& c = w.config;
  return w.workspace_bytes(KernelCall::attention_backward(dtype, w.threads, w.batch_size, c.num_attention_heads,
                                                          c.num_key_value_heads, queries, keys, c.head_dim, causal));
}

// A GEMM's workspace in the model dtype, from the calibration (out[m, n] = op(A)[m, k] · op(B)[k, n]).
std::int64_t gemm_workspace_bytes(const Workload& w, std::int64_t m, std::int64_t n, std::int64_t k, bool a_transposed,
                                  bool b_transposed = false) {
  return w.workspace_bytes(KernelCall::gemm(w.dtype, w.threads, m, n, k, a_transposed, b_transposed));
}

std::int64_t objective_bytes(const Workload& w) { return w.batch_size * w.seq_len * w.objective_bytes_per_token; }

// Checkpoints and gradients alive while layer l is back-propagated: the inputs of layers 0..l, and the gradients of
// the head and of layers l..L-1. Their sum is linear in l, so its largest value is at l = L-1 or l = 0: a method's
// layer moment is evaluated at both.
struct LayerState {
  std::int64_t layer;
  std::int64_t checkpoints, gradients;
};
std::vector<LayerState> layer_states(const Sizes& z) {
  const auto btd = z.B * z.T * z.d * z.s;
  std::vector<LayerState> out;
  for (const auto l : {z.L - 1, std::int64_t(0)}) {
    out.push_back({l, (l + 1) * btd, z.layer_gradients_at(l)});
    if (z.L == 1) break;
  }
  return out;
}

MemoryEstimate largest(std::vector<MemoryEstimate> moments) {
  return *std::max_element(moments.begin(), moments.end(), [](const auto& a, const auto& b) {
    return a.total_bytes() < b.total_bytes();
  });
}

}  // namespace

std::int64_t Workload::workspace_bytes(const KernelCall& call) const {
  if (!workspaces)
    throw std::logic_error("memory model of " + config.name + ": no kernel calibration attached to the workload (" +
                           call.describe() + ")");
  return workspaces->bytes(call);
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

// RoPE's cos and sin tables of `positions` positions ([positions, hd] in the compute dtype), one pair for q and one
// for k, saved by the rotation's multiplications: per position, not per row of the batch. Measured in MsT's
// full-sequence attention re-forward (tiny at B = 1, T = 4096: four 256 KiB blocks the model had missed, 5% of its
// peak; at B = 8, T = 1024 four 64 KiB ones). Standard BP (every layer's tables) and checkpointing (the re-forward's)
// count them too, next to full_sequence_layer_bytes_per_token (measured there: tiny fp32 T = 1024, 64 KiB blocks).
std::int64_t rope_table_bytes(const Workload& w, std::int64_t positions) {
  return 4 * positions * w.config.head_dim * Sizes(w).s;
}

std::int64_t mlp_activation_bytes_per_token(const Workload& w) {
  const Sizes z(w);
  // post norm; gate, silu(gate), up, product; A x of each adapted projection
  return norm_bytes(w.config.hidden_size, z) + 4 * w.config.intermediate_size * z.s + w.lora_mlp_targets * w.lora_rank * z.s;
}

std::int64_t layer_activation_bytes_per_token(const Workload& w, bool input_kept) {
  return attention_activation_bytes_per_token(w, input_kept) + mlp_activation_bytes_per_token(w);
}

namespace {

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
std::int64_t full_sequence_layer_bytes_per_token(const Workload& w, bool input_kept, bool input_saved = true) {
  const Sizes z(w);
  const auto input_norm_saved = (input_kept && z.f == z.s ? 0 : z.d * z.f) + z.f;
  return layer_activation_bytes_per_token(w, input_kept) + norm_statistics_bytes_per_token(w) - (input_saved ? 0 : input_norm_saved);
}

}  // namespace

namespace {

// The MLP backward over `tokens` positions holds one [tokens, I] gradient beyond the saved activations at its peak
// (measured on tiny at c = 512: without it StreamBP's model was 6.5-7.3% under the meter, with two 4-5% over).
std::int64_t mlp_backward_bytes(const Workload& w, std::int64_t tokens) {
  return tokens * w.config.intermediate_size * std::int64_t(c10::elementSize(w.dtype));
}

// What SDPA's backward over the full sequence adds (checkpointing, MsT) to the attention block's saved activations
// (the output too: the kernel's backward saved it): the gradients of the attention output, q, k, v and the kernel's
// scratch.
std::vector<MemoryTerm> attention_backward_terms(const Workload& w) {
  const Sizes z(w);
  const auto& c = w.config;
  return {{"attention gradients", z.B * z.T * (2 * c.q_width() + 2 * c.kv_width()) * z.s},
          {"attention kernel scratch", attention_scratch_bytes(w, w.dtype, z.T, z.T, true)}};
}

}  // namespace

namespace {

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

// Data parallelism (ARCHITECTURE.md §12): each group's collective at its gradient-ready event (DataParallel::reduce), with
// what is alive then. Streamed methods and checkpointing fire the events between their layers: the checkpoints of
// the layers below (the layer's own was freed before its event), dL/dH, the gradients of the groups before (reduced)
// and of this group; standard BP fires them all after its backward, when only gradients are left, every group not
// yet reduced in full. The first and last layer's events stand for every layer's (the sum is linear in l).
std::vector<MemoryEstimate> gradient_event_moments(const Workload& w, bool streamed) {
  const Sizes z(w);
  if (!w.data_parallel()) return {};
  const auto btd = z.B * z.T * z.d * z.s;
  std::vector<MemoryEstimate> out;
  const auto event = [&](const std::string& group, std::int64_t group_bytes, std::int64_t checkpoints,
                         std::int64_t gradients) {
    if (group_bytes == 0) return;  // no trainable tensor: no event
    out.push_back({group + " gradient reduction",
                   {{"weights", z.weights},
                    {"checkpoints", streamed ? checkpoints : 0},
                    {"dL/dH", streamed ? btd : 0},
                    {"gradients (the groups before reduced, this one's full)", gradients},
                    {z.sharded_gradients() ? std::string("reduce-scatter buffers ([N, slice], its slice") +
                                                 (w.collective_copies ? ", the backend's copy)" : ")")
                                           : std::string("all-reduce buffer (the group's gradients flattened)"),
                     z.reduction_buffers(group_bytes, w.collective_copies)},
                    {"objective buffers", objective_bytes(w)}}});
  };
  // Standard BP: the groups after this one still full (the layers below, an untied embedding).
  const auto untied_embedding = z.tied ? 0 : z.embedding_group;
  event("head", z.head_group, z.L * btd, streamed ? z.head_gradients : z.all_gradients);
  for (const auto l : {z.L - 1, std::int64_t(0)}) {
    const auto gradients = streamed ? z.layer_gradients_at(l)
                                    : z.head_after() + (z.L - 1 - l) * z.reduced(z.layer_grad) +
                                          (l + 1) * z.layer_grad + untied_embedding;
    event("layer " + std::to_string(l), z.layer_grad, l * btd, gradients);
    if (z.L == 1) break;
  }
  event("embedding", z.embedding_group, 0, z.embedding_backward_gradients());
  return out;
}

// ZeRO-3 (DataParallel::use): the embedding and head gathered at the step's start, when only the slices, the states
// and the batch exist; a layer gathered where its backward starts, beside what its backward moment holds but its
// gradients and activations (the forward's gathers hold less: no gradients, fewer checkpoints). Standard BP gathers
// inside autograd's backward; its moments count every layer gathered at the end instead (standard_memory).
std::vector<MemoryEstimate> parameter_gather_moments(const Workload& w, bool streamed) {
  const Sizes z(w);
  if (!z.sharded_parameters()) return {};
  const auto btd = z.B * z.T * z.d * z.s;
  std::vector<MemoryEstimate> out;
  if (z.embedding_group + z.head_group > 0)
    out.push_back({"embedding and head parameter gather (step start)",
                   {{"weights (the slices)", z.rest_weights},
                    {"gather buffers", z.gather_buffers(z.embedding_group + z.head_group, w.collective_copies)},
                    {"objective buffers", objective_bytes(w)}}});
  if (!streamed) return out;
  for (const auto& state : layer_states(z))
    out.push_back({"layer " + std::to_string(state.layer) + " parameter gather (backward)",
                   {{"weights", z.weights},
                    {"checkpoints", state.checkpoints},
                    {"dL/dH", btd},
                    {"gradients (of the head and the layers after)", state.gradients - z.layer_grad},
                    {"gather buffers", z.gather_buffers(z.layer_grad, w.collective_copies)},
                    {"objective buffers", objective_bytes(w)}}});
  return out;
}

// Every moment data parallelism adds to a method's (none for one process).
std::vector<MemoryEstimate> data_parallel_moments(const Workload& w, bool streamed) {
  auto out = gradient_event_moments(w, streamed);
  for (auto& m : parameter_gather_moments(w, streamed)) out.push_back(std::move(m));
  return out;
}

}  // namespace

MemoryEstimate standard_memory(const Workload& w) {
  const Sizes z(w);
  // Peak: log-softmax backward, with every layer's activations still alive and no gradient written yet.
  // Under LoRA the frozen embedding's output needs no gradient: layer 0 keeps less (full_sequence_layer_bytes_per_token).
  // RoPE's cos/sin tables: each layer's rotation makes its own pair for q and one for k ([T, hd] each, per position,
  // not per row of the batch), which the multiplications keep (measured: tiny fp32 B = 1, T = 1024: eight 64 KiB
  // blocks; B = 4, T = 256 LoRA: eight 16 KiB ones). The final norm's statistic, [B, T, 1] in the compute dtype.
  // (run --preset tiny --method standard --seq 1024 --timeline P; --batch 4 --seq 256 --lora rank=8.)
  const auto layers = z.L * full_sequence_layer_bytes_per_token(w, false) -
                      (z.lora ? full_sequence_layer_bytes_per_token(w, false) -
                                    full_sequence_layer_bytes_per_token(w, false, /*input_saved=*/false)
                              : 0);
  MemoryEstimate head{"head backward",
                      {{"weights", z.weights},
                       {"weight copies (compute dtype)", z.all_copies()},
                       {"layer activations", z.B * z.T * layers},
                       {"RoPE tables", z.L * rope_table_bytes(w, z.T)},
                       {"final norm", z.B * z.T * (final_norm_bytes(z.d, z, false) + z.f)},
                       {"logits + loss", loss_peak_bytes(z.T, z)},
                       {"objective buffers", objective_bytes(w)}}};
  std::vector<MemoryEstimate> moments = data_parallel_moments(w, /*streamed=*/false);
  moments.push_back(head);
  if (z.lora) return largest(moments);  // the frozen embedding has no backward
  // Or the end of the backward (short sequences): every gradient exists, and autograd's embedding backward makes a
  // dense [V, d] gradient. Tied, it is added into the lm_head's; measured, that moment holds two [V, d] blocks beyond
  // the gradients (tiny at T = 2: model 963.5 KiB against 1.1 MiB with one), as much as an untied model's peak. In
  // mixed precision the lm_head's part arrives as a fresh fp32 cast of its bf16 GEMM, and the sum is one block
  // (measured: 963.5 KiB, the model with two was 11.7% over).
  MemoryEstimate end{"embedding backward",
                     {{"weights", z.weights},
                      {"gradients", z.all_gradients},
                      {"the layers' gathered parameters (ZeRO-3: in use to the end of the backward)",
                       z.L * z.gathered_layer()},
                      {"dense embedding gradient", w.config.tie_word_embeddings ? (z.cast ? 1 : 2) * z.V * z.d * z.g : 0},
                      {"dL/dH", z.B * z.T * z.d * z.s},
                      {"objective buffers", objective_bytes(w)}}};
  moments.push_back(end);
  return largest(moments);
}

MemoryEstimate checkpoint_memory(const Workload& w) {
  const Sizes z(w);
  const auto btd = z.B * z.T * z.d * z.s;
  const auto& c = w.config;
  // The final norm's saved statistic ([B, T, 1], compute dtype) is alive with its other saved tensors.
  const auto final_norm = z.B * z.T * (final_norm_bytes(z.d, z, true) + z.f);
  MemoryEstimate head{"head backward",
                      {{"weights", z.weights},
                       {"lm_head copy (compute dtype)", z.lm_head_copy()},
                       {"checkpoints", (z.L + 1) * btd},
                       {"final norm", final_norm},
                       {"logits + loss", loss_peak_bytes(z.T, z)},
                       {"objective buffers", objective_bytes(w)}}};
  // Re-forward of a layer on the full sequence, then its backward. Measured with run --timeline (tiny and tiny-mha
  // fp32, B = 1, T = 64 and 1024; `run --preset tiny-mha --method checkpoint --seq 1024 --threads 2 --timeline P`,
  // blocks named by size and order): the two local peaks are
  //  - MLP: silu(gate)·up's backward, which makes d(silu) and d(up) while d(product) is alive: gate, up, silu and
  //    those three [B, T, I] gradients; the product itself was freed by down_proj's backward. Under LoRA the same
  //    count one step earlier: down's two partial input gradients (base and adapter path) and their sum, the product
  //    and down's A·x freed (tiny-mha LoRA fp32 T = 2048: layer peak 14.76 MB measured, 14.71 MB this moment).
  //    Of this layer's gradients only down_proj's exists.
  //  - attention: SDPA's backward (attention_backward_terms, the input/q/k norms' statistics, the RoPE tables, and
  //    h_mid's gradient); the MLP's and o_proj's gradients exist, q/k/v's and the input norm's not yet.
  // Both hold the RoPE tables of the re-forward (rope_table_bytes: four [T, hd] blocks) and the layer's output (the
  // value of layer_forward, alive until its backward returns) next to dL/dH in: "dL/dH in + out".
  // Gradients of this layer written by each moment: full fine-tuning down_proj's [d, I] (MLP), then also gate/up's and
  // the post norm's, and o_proj's (attention). Under LoRA the adapters': every MLP adapter has r·(d+I) elements (down's
  // is the first written) and o's r·(n_h·hd + d) when o is adapted.
  const auto r = w.lora_rank;
  const auto down_gradient = (z.lora ? (w.adapts("down") ? r * (z.d + c.intermediate_size) : 0)
                                     : z.d * c.intermediate_size) * z.g;
  const auto mlp_o_gradients =
      (z.lora ? w.lora_mlp_targets * r * (z.d + c.intermediate_size) +
                    (w.adapts("o") ? r * (c.q_width() + z.d) : 0)
              : 3 * z.d * c.intermediate_size + z.d + z.d * c.q_width() + (c.o_proj_bias ? z.d : 0)) * z.g;
  const auto mlp_activations = z.B * z.T * (full_sequence_layer_bytes_per_token(w, true) - c.intermediate_size * z.s -
                                            (w.adapts("down") ? r * z.s : 0));
  const auto attention_statistics =
      z.B * z.T * (norm_statistics_bytes_per_token(w) - z.f);  // all but the post norm's (freed with the MLP's graph)
  std::vector<MemoryEstimate> moments = {head};
  for (const auto& state : layer_states(z)) {
    const auto layer = "layer " + std::to_string(state.layer) + " backward";
    const auto earlier = state.gradients - z.layer_grad;  // the head's and the layers' after this one
    const std::vector<MemoryTerm> common = {{"weights", z.weights},
                                            {"the layer's gathered parameters (ZeRO-3)", z.gathered_layer()},
                                            {"weight copies (compute dtype)", z.layer_copies()},
                                            {"checkpoints", state.checkpoints},
                                            {"dL/dH in + out", 2 * btd},
                                            {"RoPE tables", rope_table_bytes(w, z.T)},
                                            {"objective buffers", objective_bytes(w)}};
    MemoryEstimate mlp{layer + " (MLP)", common};
    mlp.terms.insert(mlp.terms.end(),
                     {{"gradients (this layer's: down_proj's)", earlier + down_gradient},
                      {"layer activations but the MLP product", mlp_activations},
                      {"MLP gradients: d(product), d(silu), d(up)", 3 * z.B * z.T * c.intermediate_size * z.s}});
    MemoryEstimate attention{layer + " (attention)", common};
    attention.terms.push_back({"gradients (this layer's: the MLP's, o_proj's)", earlier + mlp_o_gradients});
    attention.terms.push_back({"attention activations", z.B * z.T * attention_activation_bytes_per_token(w, true)});
    for (const auto& t : attention_backward_terms(w)) attention.terms.push_back(t);
    attention.terms.push_back({"input and q/k norm statistics", attention_statistics});
    attention.terms.push_back({"h_mid's gradient", btd});
    moments.push_back(mlp);
    moments.push_back(attention);
    // Full fine-tuning, short sequences: down_proj's weight gradient GEMM (grad^T · product over B·T rows), while
    // the product (its input) and d(product) are alive, with the GEMM's workspace; in mixed precision its output is
    // then widened into the fp32 gradient (after the workspace is gone). Measured on an AVX512_CORE CPU, bf16:
    // tiny-mha B = 1, T = 64 (`run --preset tiny-mha --method checkpoint --seq 64 --dtype bf16 --timeline P`): the
    // layer's peak, a 32.1 KiB workspace (an fp32 copy of the output) next to the 16 KiB bf16 gradient; the MLP moment
    // above was 2.6% under the meter without this one.
    if (!z.lora) {
      const auto down_elements = z.d * c.intermediate_size;
      const auto workspace = gemm_workspace_bytes(w, z.d, c.intermediate_size, z.B * z.T, /*a_transposed=*/true);
      MemoryEstimate down{layer + " (down_proj weight gradient)", common};
      down.terms.insert(down.terms.end(),
                        {{"gradients (this layer's: none yet)", earlier},
                         {"down_proj's gradient (model dtype) + the GEMM's workspace or the fp32 cast",
                          down_elements * z.s + std::max(workspace, z.cast ? down_elements * z.g : 0)},
                         {"layer activations", z.B * z.T * full_sequence_layer_bytes_per_token(w, true)},
                         {"d(product)", z.B * z.T * c.intermediate_size * z.s}});
      moments.push_back(down);
    }
  }
  // Short sequences: the lm_head's weight gradient GEMM (grad^T · normed hidden states, [V, d] output) with its
  // workspace (on an AVX512_CORE CPU in bf16 an fp32 copy of the output: qwen3-small bf16, T = 64: 661 MiB measured,
  // 395 MiB modelled without it); then the end of the step, when every gradient exists.
  if (z.g == z.s && z.lm_grad > 0)
    moments.push_back({"lm_head gradient GEMM",
                       {{"weights", z.weights},
                        {"checkpoints", (z.L + 1) * btd},
                        {"final norm", final_norm},
                        {"logits gradient (model dtype)", z.B * z.T * z.V * z.s},
                        {"lm_head gradient + the GEMM's workspace",
                         z.lm_grad + gemm_workspace_bytes(w, z.V, z.d, z.B * z.T, /*a_transposed=*/true)},
                        {"objective buffers", objective_bytes(w)}}});
  moments.push_back(embedding_moment(w));
  for (auto& m : data_parallel_moments(w, /*streamed=*/true)) moments.push_back(std::move(m));
  return largest(moments);
}

namespace {

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
                                           {"checkpoints", (z.L + 1) * btd},
                                           {"dL/dH", btd},
                                           {"lm_head gradient", lm_gradient},
                                           {"head chunk", head_logits + z.B * ch * final_norm_bytes(z.d, z, true, true)},
                                           {"head GEMMs or final norm backward", head_work},
                                           {"objective buffers", objective_bytes(w)}}}};
  // The logits GEMM of a later chunk writes into the blocks the earlier chunks left (bf16: its model-dtype product,
  // with whatever the GEMM takes beyond its output, e.g. an fp32 copy of it on an AVX512_CORE CPU).
  moments.push_back({"head forward (logits GEMM)",
                     {{"weights", z.weights},
                      {"checkpoints", (z.L + 1) * btd},
                      {"dL/dH", btd},
                      {"lm_head gradient", ch < z.T ? lm_gradient : 0},
                      {"head chunk", head_logits + z.B * ch * final_norm_bytes(z.d, z, true, true)},
                      {"the GEMM's workspace (+ the lm_head's compute-dtype copy)",
                       gemm_workspace_bytes(w, z.B * ch, z.V, z.d, false, /*b_transposed=*/true) + z.lm_head_copy()},
                      {"objective buffers", objective_bytes(w)}}});
  if (sums_wider)
    moments.push_back({"lm_head gradient commit",
                       {{"weights", z.weights},
                        {"checkpoints", (z.L + 1) * btd},
                        {"dL/dH", btd},
                        {"lm_head gradient (fp32 sum + bf16)", z.lm_grad * (z.f + z.g) / z.g},
                        {"objective buffers", objective_bytes(w)}}});
  // DPO's pass 1 (and GRPO's sequence ratio with given old log-probs): logits of one head chunk without a graph.
  if (w.statistics_pass && ch < z.T)
    moments.push_back({"statistics pass",
                       {{"weights", z.weights},
                        {"checkpoints", (z.L + 1) * btd},
                        {"head chunk", z.B * ch * (z.V * z.f + z.d * (z.f + z.s))},
                        {"objective buffers", objective_bytes(w)}}});
  return moments;
}


}  // namespace

MemoryEstimate streambp_memory(const Workload& w, std::int64_t layer_chunk, std::int64_t head_chunk) {
  const Sizes z(w);
  const auto& cfg = w.config;
  const auto c = std::min(layer_chunk, z.T);
  const auto btd = z.B * z.T * z.d * z.s;
  const auto qw = cfg.q_width(), kw = cfg.kv_width(), I = cfg.intermediate_size;
  const auto kv = z.B * z.T * kw * z.s;  // one of K, V: [B, n_kv, T, hd]
  // The worst chunk of a layer's step 2 is its last one: the most keys (`prefix` before it), as many rows as any.
  // A layer of one chunk (T <= c) is special: its weight gradients do not exist yet while the chunk is
  // back-propagated (ChunkGradients starts its sums afterwards; tiny fp32 T = 64: 104 KiB the model had too many).
  const bool one_chunk = c >= z.T;
  const auto prefix = (z.T - 1) / c * c;
  // bf16: dK/dV and the layer's weight gradients are summed in fp32 (ChunkGradients); K/V prefix tiles of
  // kPrefixTile keys are upcast to fp32 inside chunk attention.
  const bool sums_wider = z.f > z.s;

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
  // The kernel runs on fp32 copies of bf16 blocks: its scratch is the fp32 kernel's (tiny bf16, c = 128: 256 KiB).
  const auto key_block = [&](std::int64_t keys, bool after_first, bool diagonal) {
    return (sums_wider ? 4 : 2) * z.B * keys * kw * z.f +
           attention_scratch_bytes(w, compute_dtype(w.dtype), c, keys, diagonal) + (after_first ? q_rows * z.f : 0);
  };
  const auto tile = sums_wider ? std::min<std::int64_t>(1024, prefix) : prefix;
  const auto block_gradients = std::max(prefix > 0 ? key_block(tile, tile < prefix, false) : 0, key_block(c, prefix > 0, true));
  const auto attention_moment = z.B * c * (q_path - o_proj_input) + q_rope + 2 * out + fresh_attention +
                                block_gradients + dq_path;
  const auto chunk = std::max(mlp_moment, attention_moment);
  // The layer's weight gradients while its chunks run: none yet for a single chunk; else the sums of every chunk so
  // far (the fp32 sums in bf16), without k_proj/v_proj (and k_norm), which only step 3 (kv_path) makes.
  const auto kv_proj_grads = z.lora ? 0 : (2 * z.d * kw + (cfg.attention_bias ? 2 * kw : 0) + (cfg.qk_norm ? cfg.head_dim : 0)) * z.g;
  const auto layer_sums = one_chunk ? 0 : (z.layer_grad - kv_proj_grads) * (z.g < z.f ? z.f / z.g : 1);
  auto moments = streamed_head_moments(w, head_chunk);
  for (const auto& state : layer_states(z))
    moments.push_back({"layer " + std::to_string(state.layer) + " backward",
                       {{"weights", z.weights},
                        {"the layer's gathered parameters (ZeRO-3, the whole chunk loop)", z.gathered_layer()},
                        {"weight copies (compute dtype)", z.layer_copies()},
                        {"gradients (of the head and the layers after)", state.gradients - z.layer_grad},
                        {"layer gradient sums (none for one chunk)", layer_sums},
                        {"checkpoints", state.checkpoints},
                        {"dL/dH (out, overwritten by in)", btd},
                        {"K, V, dK, dV", 2 * kv + 2 * kv * z.f / z.s},
                        {"layer chunk", chunk},
                        {"objective buffers", objective_bytes(w)}}});
  moments.push_back(embedding_moment(w));
  for (auto& m : data_parallel_moments(w, /*streamed=*/true)) moments.push_back(std::move(m));
  return largest(moments);
}

MemoryEstimate mst_memory(const Workload& w, std::int64_t mini_seq_len) {
  const Sizes z(w);
  const auto c = std::min(mini_seq_len, z.T);
  const auto btd = z.B * z.T * z.d * z.s;
  const auto& cfg = w.config;
  // Re-forward of a layer (the last one, with all gradients but an untied embedding's): attention on the full
  // sequence with its graph, h_mid and its gradient; then either one MLP mini-sequence's activations, or the
  // attention block's backward (below). The layer input's gradient (dL/dH in) is only made by that backward, at its
  // end, when the activations are gone (measured: not alive during the MLP mini-sequences nor at either
  // attention-backward peak, tiny bf16 B = 8 T = 4096).
  auto moments = streamed_head_moments(w, c);
  for (const auto& state : layer_states(z)) {
    const auto layer = "layer " + std::to_string(state.layer) + " backward";
    // bf16: the MLP's weight (or adapter) gradients summed over the mini-sequences in fp32 (ChunkGradients).
    const auto mlp_gradient_elements = z.lora ? w.lora_mlp_targets * w.lora_rank * (z.d + cfg.intermediate_size)
                                              : 3 * z.d * cfg.intermediate_size + z.d;
    // The attention block's saved activations (see the attention backward's notes below) and its norms' statistics
    // (the input norm's, q's and k's rsqrt rows; the post norm's is the MLP's).
    const auto rsqrt_rows = z.B * z.T * (norm_statistics_bytes_per_token(w) - z.f);
    const auto attention_saved = z.B * z.T * attention_activation_bytes_per_token(w, true);
    // Alive at every moment of the layer: the layer input's gradient (dL/dH in) is made only at its end.
    const std::vector<MemoryTerm> common = {{"weights", z.weights},
                                            {"the layer's gathered parameters (ZeRO-3)", z.gathered_layer()},
                                            {"checkpoints", state.checkpoints},
                                            {"dL/dH out", btd},
                                            {"h_mid + its gradient", 2 * btd},
                                            {"objective buffers", objective_bytes(w)}};
    MemoryEstimate mlp{layer + " (MLP mini-sequence)", common};
    mlp.terms.insert(mlp.terms.end(),
                     {{"weight copies (compute dtype)", z.layer_copies()},
                      {"gradients", state.gradients},
                      {"attention activations (o_proj's input is SDPA's output)", attention_saved},
                      {"RMSNorm rsqrt rows (fp32)", rsqrt_rows},
                      {"RoPE tables", rope_table_bytes(w, z.T)},
                      {"MLP mini-sequence", z.B * c * mlp_activation_bytes_per_token(w)},
                      {"MLP gradient sums (fp32)", z.f > z.g ? mlp_gradient_elements * z.f : 0}});
    // The attention block's backward (h_mid.backward(g_mid)), measured with run --timeline (the blocks alive at its
    // peak) on tiny fp32 and bf16 B = 8 T = 4096, bf16-mixed LoRA B = 4 T = 4096, tiny-mha fp32 B = 1 T = 64:
    //   streambp run --preset tiny --method mst:mini_seq=64 --batch 8 --seq 4096 --dtype bf16 --threads 2 --timeline P
    // - g_mid (dL/dh_mid) stays alive to the end of the layer (layer_backward holds it) next to h_mid and dL/dH out.
    // - Layer l's q/k/v projection and norm weight gradients do not exist yet (their backward comes later; o_proj's
    //   does): at tiny-mha fp32 B = 1 T = 64 the model held 48 KiB of them too many (3 x [64, 64] fp32), 3.8% over.
    //   Of the layer's compute-dtype weight copies (mixed precision) only q/k/v's (and the norms') are still saved.
    //   Under LoRA the same holds for the adapters: the MLP's and o's gradients exist, q/k/v's not; o's A x and copy
    //   are freed by o_proj's backward (bf16-mixed LoRA B = 4 T = 64: 18 KiB of MLP and 4 KiB of o adapter gradients,
    //   q/k/v's 1.5 KiB copies and 4 KiB A x each; the model held 30 KiB more, 2.8% over).
    const bool o_adapted = z.lora && w.adapts("o");
    const auto lora_attention_elements =
        z.lora ? w.lora_parameters / std::max<std::int64_t>(1, z.L) -
                     w.lora_mlp_targets * w.lora_rank * (z.d + cfg.intermediate_size)
               : 0;
    const auto qkv_elements =
        z.lora ? lora_attention_elements - (o_adapted ? w.lora_rank * (cfg.q_width() + z.d) : 0)
               : (z.d + (cfg.attention_bias ? 1 : 0)) * (cfg.q_width() + 2 * cfg.kv_width()) + z.d +
                     (cfg.qk_norm ? 2 * cfg.head_dim : 0);
    const auto gradients_before_qkv = state.gradients - qkv_elements * z.g;
    const auto qkv_copies = qkv_elements * z.cast;
    const auto o_lora_inputs = o_adapted ? z.B * z.T * w.lora_rank * z.s : 0;  // o's A x, freed
    // - SDPA's output is [B, T, n_h, hd] storage viewed as [B, n_h, T, hd]: Model::attend's transpose + reshape is a
    //   view, so o_proj saves the output itself, no [T, n_h*hd] copy: the fp32 B = 8 T = 4096 peak holds one 8 MiB
    //   [B, T, n_h*hd] block, not two.
    // - Each RMSNorm also saves its fp32 rsqrt row per token and head (input norm 1, q_norm n_h, k_norm n_kv): 896 KiB
    //   at bf16 B = 8 T = 4096, not in the shared per-token terms.
    // (a) SDPA's backward: every activation of the block saved, the gradients of the attention output, q, k, v
    //     (attention_backward_terms) and the flash kernel's scratch (bf16 B = 8 T = 4096: 83.8 MiB live, of it
    //     grad_out 4 + grad_q 4 + grad_k 2 + grad_v 2 MiB and scratch 2 + 1 MiB).
    // Both moments of the attention block's backward: its q/k/v gradients (and copies) do not exist yet.
    auto before_qkv = common;
    before_qkv.insert(before_qkv.end(), {{"q/k/v weight copies (compute dtype)", qkv_copies},
                                         {"gradients (but layer's q/k/v/norms)", gradients_before_qkv}});
    MemoryEstimate attention{layer + " (attention)", before_qkv};
    attention.terms.insert(attention.terms.end(),
                           {{"attention activations (o_proj's input is SDPA's output) but o's A x",
                             attention_saved - o_lora_inputs},
                            {"RMSNorm rsqrt rows (fp32)", rsqrt_rows},
                            {"RoPE tables", rope_table_bytes(w, z.T)}});
    for (const auto& t : attention_backward_terms(w)) attention.terms.push_back(t);
    moments.push_back(mlp);
    moments.push_back(attention);
    // (b) qk_norm: q's RMSNorm backward, right after SDPA's and RoPE's backward (q was computed last, so its path is
    //     back-propagated first). SDPA's saved q, k, v, output and log-sum-exp, q's rotated copy, normed output and
    //     rsqrt rows and q's RoPE tables are freed; its saved fp32 input ([B, T, n_h*hd], the projection output cast)
    //     is alive, and so are the input norm's and k's saved tensors, k's RoPE tables and the k/v gradients (the
    //     CPU kernel makes them with n_kv heads). The norm's autograd backward holds five [B, T, n_h*hd] temporaries
    //     in the statistics dtype at its peak (grad·rsqrt, mean's expanded gradient, xc.pow(1), 2·xc.pow(1) and
    //     grad·2·xc: pow's backward); in bf16 they are fp32, twice the size of everything else, and this is the
    //     layer's peak: bf16 B = 8 T = 4096 measured 94.9 MiB, of it 5 x 8 MiB temporaries, q's 8 MiB input, the
    //     input norm's 16.1 MiB, k's 6.3 MiB, grad_k + grad_v 4 MiB (the model before this moment: 82.8 MiB,
    //     14.6% under); bf16-mixed LoRA B = 4 T = 4096: 45.5 MiB, of it 5 x 4 MiB.
    if (cfg.qk_norm) {
      const auto qw = cfg.q_width(), kw = cfg.kv_width();
      // Input norm: its per-token share of the shared term (saved fp32 input, normed output, scaled output);
      // k: the norm's saved input and (full fine-tuning) normed output, not the rotated copy SDPA kept; under LoRA
      // the A x of each adapted projection but o.
      const auto input_norm = norm_bytes(z.d, z) - (z.f == z.s ? z.d * z.f : 0);
      const auto k_saved = kw * (z.f + (z.lora ? 0 : 1) * z.s);
      const auto per_token = input_norm + k_saved + qw * z.f +
                             (w.lora_attention_targets - (o_adapted ? 1 : 0)) * w.lora_rank * z.s +
                             (1 + cfg.num_key_value_heads) * z.f;  // rsqrt rows of the input norm and k_norm
      MemoryEstimate q_norm{layer + " (q norm backward)", before_qkv};
      q_norm.terms.insert(q_norm.terms.end(),
                          {{"input norm's, k's and q norm's saved tensors", z.B * z.T * per_token},
                           {"k's RoPE tables", rope_table_bytes(w, z.T) / 2},
                           {"k, v gradients", 2 * z.B * z.T * kw * z.s},
                           {"q norm backward temporaries (5, statistics dtype)", 5 * z.B * z.T * qw * z.f}});
      moments.push_back(q_norm);
    }
  }
  moments.push_back(embedding_moment(w));
  for (auto& m : data_parallel_moments(w, /*streamed=*/true)) moments.push_back(std::move(m));
  return largest(moments);
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

MemoryEstimate training_memory(const BackpropMethod& method, const Workload& w) {
  auto bp = method.memory_model(w);
  const Sizes z(w);
  // Not modelled moment by moment: a later micro-batch's BP beside the gradients the earlier ones left (each
  // method's moments count only the gradients that exist by then). An upper bound: all of them on top (measured on
  // tiny, T = 64: 12-17% above the single-batch model, which the bound covers).
  if (w.accumulating) {
    bp.moment += " (upper bound: a later micro-batch)";
    bp.terms.push_back({"gradients of the earlier micro-batches", z.all_gradients});
  }
  if (w.optimizer_state_bytes == 0 && w.optimizer_update_bytes == 0) return bp;
  // Data-parallel (ZeRO 1-3): the states are this rank's slices' (add_optimizer_memory), the update's temporaries
  // those of its longest slice, the gradients after the events its slices (stages 2-3), the weights between steps
  // its slices (stage 3).
  bp.terms.push_back({"optimizer states", w.optimizer_state_bytes});
  // After the last micro-batch: every gradient exists (clipped in place), the activations are gone.
  MemoryEstimate update{"optimizer step",
                        {{"weights", z.rest_weights},
                         {"gradients", z.step_gradients()},
                         {"optimizer states", w.optimizer_state_bytes},
                         {"the update's temporaries", w.optimizer_update_bytes}}};
  if (!w.data_parallel() || w.zero_stage == 0) return largest({bp, update});
  // ZeRO 1-3, around the update (DataParallel): the gradient norm summed over the ranks' slices in fp64 (each slice's
  // gradient converted, unless fp64 already, and squared: two [slice] fp64 temporaries of the longest slice); after
  // it (stages 1-2), each group's updated slices all-gathered: this rank's [slice] packed, the [N, slice] result and
  // the backend's copy of it (collective_copies). Both with every gradient and state still alive.
  const auto longest_slice = (z.largest_tensor + z.N - 1) / z.N;
  MemoryEstimate norm{"gradient norm (fp64, over the slices)",
                      {{"weights", z.rest_weights},
                       {"gradients", z.step_gradients()},
                       {"optimizer states", w.optimizer_state_bytes},
                       {"fp64 copy and square of the longest slice's gradient",
                        (z.g == 8 ? 1 : 2) * 8 * longest_slice}}};
  if (z.sharded_parameters()) return largest({bp, update, norm});  // the slices are the parameters: no gather
  const auto largest_group = std::max({z.head_group, z.layer_grad, z.embedding_group});
  MemoryEstimate gather{"all-gather of the updated slices",
                        {{"weights", z.rest_weights},
                         {"gradients", z.step_gradients()},
                         {"optimizer states", w.optimizer_state_bytes},
                         {std::string("the largest group's slice, gathered [N, slice]") +
                              (w.collective_copies ? " and the backend's copy" : ""),
                          (z.N + 1 + (w.collective_copies ? z.N : 0)) * z.slice_elements(largest_group) * z.g}}};
  return largest({bp, update, norm, gather});
}

}  // namespace sbp
