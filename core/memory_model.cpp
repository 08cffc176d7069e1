#include "core/memory_model.h"

#include <algorithm>

#include "core/dtype.h"

namespace sbp {
namespace {

struct Sizes {
  std::int64_t s, f;                // bytes per element: model dtype, compute dtype (norm statistics, logits)
  std::int64_t B, T, d, V, L, P;
  explicit Sizes(const Workload& w)
      : s(std::int64_t(c10::elementSize(w.dtype))),
        f(std::int64_t(c10::elementSize(compute_dtype(w.dtype)))),
        B(w.batch_size), T(w.seq_len), d(w.config.hidden_size), V(w.config.vocab_size),
        L(w.config.num_hidden_layers), P(w.config.num_parameters()) {}
};

// Per token: the saved input of an RMSNorm in compute dtype (pow/mul keep it), its normalised output and the
// scaled output (kept by the projections that follow) in model dtype.
std::int64_t norm_bytes(std::int64_t width, const Sizes& z) { return width * (z.f + 2 * z.s); }

// Cross-entropy over c positions at its worst moment (log-softmax backward): the saved log-softmax output, the
// gradient coming from nll_loss and the gradient it produces, all [B, c, V] in compute dtype.
std::int64_t loss_peak_bytes(std::int64_t c, const Sizes& z) { return 3 * z.B * c * z.V * z.f; }

std::int64_t objective_bytes(const Workload& w) { return w.batch_size * w.seq_len * w.objective_bytes_per_token; }

MemoryEstimate largest(std::vector<MemoryEstimate> moments) {
  return *std::max_element(moments.begin(), moments.end(), [](const auto& a, const auto& b) {
    return a.total_bytes() < b.total_bytes();
  });
}

}  // namespace

std::int64_t MemoryEstimate::total_bytes() const {
  std::int64_t total = 0;
  for (const auto& t : terms) total += t.bytes;
  return total;
}

std::int64_t attention_activation_bytes_per_token(const ModelConfig& c, c10::ScalarType dtype) {
  const Sizes z(Workload{c, dtype, 1, 1});
  const auto qw = c.q_width(), kw = c.kv_width();
  // q/k: projection output (the norm's saved input) + normalised + rotated (kept by attention); without qk_norm
  // only the rotated copy stays.
  const auto qk = c.qk_norm ? (qw + kw) * (z.f + 2 * z.s) : (qw + kw) * z.s;
  const auto attention = kw * z.s                      // v (kept by attention)
                         + 2 * qw * z.s                // attention output + its [c, n_h*hd] copy for o_proj
                         + c.num_attention_heads * 4;  // log-sum-exp rows (fp32)
  return norm_bytes(c.hidden_size, z) + qk + attention;
}

std::int64_t mlp_activation_bytes_per_token(const ModelConfig& c, c10::ScalarType dtype) {
  const Sizes z(Workload{c, dtype, 1, 1});
  return norm_bytes(c.hidden_size, z) + 4 * c.intermediate_size * z.s;  // post norm; gate, silu(gate), up, product
}

std::int64_t layer_activation_bytes_per_token(const ModelConfig& c, c10::ScalarType dtype) {
  return attention_activation_bytes_per_token(c, dtype) + mlp_activation_bytes_per_token(c, dtype);
}

MemoryEstimate standard_memory(const Workload& w) {
  const Sizes z(w);
  // Peak: log-softmax backward, with every layer's activations still alive and no gradient written yet.
  return {"head backward",
          {{"weights", z.P * z.s},
           {"layer activations", z.L * z.B * z.T * layer_activation_bytes_per_token(w.config, w.dtype)},
           {"final norm", z.B * z.T * norm_bytes(z.d, z)},
           {"logits + loss", loss_peak_bytes(z.T, z)},
           {"objective buffers", objective_bytes(w)}}};
}

MemoryEstimate checkpoint_memory(const Workload& w) {
  const Sizes z(w);
  const auto btd = z.B * z.T * z.d * z.s;
  MemoryEstimate head{"head backward",
                      {{"weights", z.P * z.s},
                       {"checkpoints", (z.L + 1) * btd},
                       {"final norm", z.B * z.T * norm_bytes(z.d, z)},
                       {"logits + loss", loss_peak_bytes(z.T, z)},
                       {"objective buffers", objective_bytes(w)}}};
  // Re-forward of layer 0: all gradients but an untied embedding's, one layer's activations, dL/dH in and out.
  const auto embed_grad_later = w.config.tie_word_embeddings ? 0 : z.V * z.d * z.s;
  MemoryEstimate layer{"layer backward",
                       {{"weights", z.P * z.s},
                        {"gradients", z.P * z.s - embed_grad_later},
                        {"checkpoints", btd},
                        {"layer activations", z.B * z.T * layer_activation_bytes_per_token(w.config, w.dtype)},
                        {"dL/dH in + out", 2 * btd},
                        {"objective buffers", objective_bytes(w)}}};
  return largest({head, layer});
}

namespace {

// The streamed head (streamed_head, shared by StreamBP and MsT) at its worst moment, and its statistics pass.
std::vector<MemoryEstimate> streamed_head_moments(const Workload& w, std::int64_t head_chunk) {
  const Sizes z(w);
  const auto ch = std::min(head_chunk, z.T);
  const auto btd = z.B * z.T * z.d * z.s;
  // Head chunk: one [B, c_h, V] buffer holds the logits and then, in place, their gradient (plus, for bf16, the
  // model-dtype logits it was cast from and the gradient cast back); the lm_head gradient exists from the second
  // chunk on and is accumulated inside the GEMM, so no [V, d] temporary.
  const auto head_logits = z.B * ch * z.V * (z.f + (z.s < z.f ? z.s : 0));
  std::vector<MemoryEstimate> moments = {{"head backward",
                                          {{"weights", z.P * z.s},
                                           {"checkpoints", (z.L + 1) * btd},
                                           {"dL/dH", btd},
                                           {"lm_head gradient", z.T > ch ? z.V * z.d * z.s : 0},
                                           {"head chunk", head_logits + z.B * ch * norm_bytes(z.d, z)},
                                           {"objective buffers", objective_bytes(w)}}}};
  // DPO's pass 1 (and GRPO's sequence ratio with given old log-probs): logits of one head chunk without a graph.
  if (w.statistics_pass && ch < z.T)
    moments.push_back({"statistics pass",
                       {{"weights", z.P * z.s},
                        {"checkpoints", (z.L + 1) * btd},
                        {"head chunk", z.B * ch * (z.V * z.f + z.d * (z.f + z.s))},
                        {"objective buffers", objective_bytes(w)}}});
  return moments;
}

// Embedding backward: the dense [V, d] gradient of the lookup before it is added to the (tied) gradient.
MemoryEstimate embedding_moment(const Workload& w) {
  const Sizes z(w);
  return {"embedding backward",
          {{"weights", z.P * z.s}, {"gradients", z.P * z.s}, {"dL/dH", z.B * z.T * z.d * z.s},
           {"lookup gradient", z.V * z.d * z.s}, {"objective buffers", objective_bytes(w)}}};
}

}  // namespace

MemoryEstimate streambp_memory(const Workload& w, std::int64_t layer_chunk, std::int64_t head_chunk) {
  const Sizes z(w);
  const auto c = std::min(layer_chunk, z.T);
  const auto btd = z.B * z.T * z.d * z.s;
  const auto lm_grad = z.V * z.d * z.s;
  const auto kv = z.B * z.T * w.config.kv_width() * z.s;  // one of K, V, dK, dV: [B, n_kv, T, hd]
  // Last chunk of layer L-1: all gradients (an untied embedding's comes last), K/V + dK/dV of the layer, the
  // chunk's activations and the [B, n_kv, T, hd] gradients of its K/V prefix.
  const auto embed_grad_later = w.config.tie_word_embeddings ? 0 : lm_grad;
  MemoryEstimate layer{"layer backward",
                       {{"weights", z.P * z.s},
                        {"gradients", z.P * z.s - embed_grad_later},
                        {"checkpoints", z.L * btd},
                        {"dL/dH in + out", 2 * btd},
                        {"K, V, dK, dV", 4 * kv},
                        {"layer chunk", z.B * c * layer_activation_bytes_per_token(w.config, w.dtype) + 2 * kv},
                        {"objective buffers", objective_bytes(w)}}};
  auto moments = streamed_head_moments(w, head_chunk);
  moments.push_back(layer);
  moments.push_back(embedding_moment(w));
  return largest(moments);
}

MemoryEstimate mst_memory(const Workload& w, std::int64_t mini_seq_len) {
  const Sizes z(w);
  const auto c = std::min(mini_seq_len, z.T);
  const auto btd = z.B * z.T * z.d * z.s;
  // Re-forward of a layer (the last one, with all gradients but an untied embedding's): attention on the full
  // sequence with its graph, h_mid and its gradient, and one MLP mini-sequence's activations.
  const auto embed_grad_later = w.config.tie_word_embeddings ? 0 : z.V * z.d * z.s;
  MemoryEstimate layer{"layer backward",
                       {{"weights", z.P * z.s},
                        {"gradients", z.P * z.s - embed_grad_later},
                        {"checkpoints", z.L * btd},
                        {"dL/dH in + out", 2 * btd},
                        {"attention activations", z.B * z.T * attention_activation_bytes_per_token(w.config, w.dtype)},
                        {"h_mid + its gradient", 2 * btd},
                        {"MLP mini-sequence", z.B * c * mlp_activation_bytes_per_token(w.config, w.dtype)},
                        {"objective buffers", objective_bytes(w)}}};
  auto moments = streamed_head_moments(w, c);
  moments.push_back(layer);
  moments.push_back(embedding_moment(w));
  return largest(moments);
}

MemoryEstimate reference_pass_memory(const Workload& w, std::int64_t layer_chunk, std::int64_t head_chunk) {
  const Sizes z(w);
  const auto c = std::min(layer_chunk, z.T), ch = std::min(head_chunk, z.T);
  const auto btd = z.B * z.T * z.d * z.s;
  const auto kv = z.B * z.T * w.config.kv_width() * z.s;
  const auto logps = z.B * z.T * 8;  // the [B, T] fp64 result
  // A chunk without a graph: the normed input, q and its RoPE temporaries, the attention output, the MLP's gate, up
  // and their product.
  const auto chunk = z.B * c * (2 * z.d + 4 * w.config.q_width() + 3 * w.config.intermediate_size) * z.s;
  MemoryEstimate layer{"reference layer",
                       {{"reference weights", z.P * z.s}, {"hidden states in + out", 2 * btd}, {"K, V", 2 * kv},
                        {"layer chunk", chunk}, {"log-probs", logps}}};
  MemoryEstimate head{"reference head",
                      {{"reference weights", z.P * z.s}, {"hidden states", btd},
                       {"head chunk", 2 * z.B * ch * z.V * z.f + z.B * ch * norm_bytes(z.d, z)}, {"log-probs", logps}}};
  return largest({layer, head});
}

}  // namespace sbp
