#include "core/methods/flop_model.h"

#include <algorithm>

namespace sbp {

FlopTerms flop_terms(const Workload& w) {
  const auto& c = w.config;
  const double N = double(w.batch_size) * double(w.seq_len), T = double(w.seq_len), d = double(c.hidden_size);
  const double q = double(c.q_width()), kv = double(c.kv_width()), I = double(c.intermediate_size);
  const double L = double(c.num_hidden_layers), r = double(w.lora_rank);
  const bool lora = w.lora_rank > 0, attention_adapters = lora && w.lora_attention_targets > 0,
             mlp_adapters = lora && w.lora_mlp_targets > 0;
  FlopTerms f;
  // Projections: 2 FLOPs per multiply-add; an adapter on a [out, in] projection costs r·(in + out) per token (A x,
  // then B (A x)). Only all-attention / all-MLP target sets are modelled (PEFT's all-linear and the usual q,k,v,o).
  f.kv_base = 2 * N * L * 2 * d * kv;
  f.kv_adapters = attention_adapters ? 2 * N * L * r * 2 * (d + kv) : 0;
  f.layer_base = 2 * N * L * (d * q + 2 * d * kv + q * d + 3 * d * I);
  f.layer_adapters = 2 * N * L * r * ((attention_adapters ? (d + q) + 2 * (d + kv) + (q + d) : 0) +
                                      (mlp_adapters ? 3 * (d + I) : 0));
  // A frozen base's backward is one product (the input's gradient); a trained weight's two; an adapter's two (the
  // input's gradient through A, and A's and B's weight gradients, r-sized).
  f.base_backward = lora ? 1 : 2;
  // Under LoRA the embedding is frozen, so standard BP never needs the gradient of layer 0's input: autograd skips
  // the input-gradient products of layer 0's q/k/v projections and their adapters' A (the methods that keep a
  // layer's input as a leaf compute them).
  f.first_layer_skipped = lora ? 2 * N * d * (q + 2 * kv) + (attention_adapters ? 2 * N * r * d * 3 : 0) : 0;
  // Every row's causal triangle, or on packed rows every sequence's: a sequence attends within itself only, and no
  // method scores (or masks) a pair across a boundary (packed_attention.h).
  const double pairs = w.packed ? w.packed->causal_pairs() : double(w.batch_size) * T * (T + 1) / 2;
  f.attention = 2 * 2 * double(c.num_attention_heads) * double(c.head_dim) * pairs * L;
  f.head = 2 * N * d * double(c.vocab_size);
  f.head_backward = lora ? 1 : 2;
  return f;
}

double FlopTerms::projections(double base, double adapters, bool with_backward) const {
  return with_backward ? base * (1 + base_backward) + adapters * 3 : base + adapters;
}

double standard_flops(const Workload& w) {
  const auto f = flop_terms(w);
  return f.projections(f.layer_base, f.layer_adapters, true) - f.first_layer_skipped +
         f.attention * (1 + FlopTerms::kAttentionBackward) + f.head * (1 + f.head_backward);
}

double checkpoint_flops(const Workload& w) {
  const auto f = flop_terms(w);
  return f.projections(f.layer_base, f.layer_adapters, true) + f.projections(f.layer_base, f.layer_adapters, false) +
         f.attention * (2 + FlopTerms::kAttentionBackward) + f.head * (1 + f.head_backward);
}

double mst_flops(const Workload& w) {
  const auto f = flop_terms(w);
  return checkpoint_flops(w) + (w.statistics_pass ? f.head : 0);  // its head is the streamed one
}

double streambp_attention_flops(const Workload& w) {
  // chunk_attention scores a chunk's queries [s, s+c) against the prefix [0, s) in full and the diagonal block
  // causally (or, CUDA bf16, one bottom-right causal call over [0, s+c)): c·s + c(c+1)/2 pairs, so a pass over the
  // chunks covers the causal triangle's rows once, T(T+1)/2 pairs per head for any chunk size. Forward, step 2's
  // re-forward, and the backward (tests/unit/test_flop_model.cpp counts them).
  return flop_terms(w).attention * (2 + FlopTerms::kAttentionBackward);
}

std::vector<PhaseFlops> streambp_phase_flops(const Workload& w, std::int64_t head_chunk) {
  const auto f = flop_terms(w);
  const bool statistics = head_chunk <= 0 ? w.statistics_pass : w.runs_statistics_pass(head_chunk);
  return {{"forward", f.projections(f.layer_base, f.layer_adapters, false) + f.attention},
          {"statistics", statistics ? f.head : 0},  // the streamed head's statistics pass: logits only
          {"head", f.head * (1 + f.head_backward)},
          {"kv_recompute", f.projections(f.kv_base, f.kv_adapters, false)},  // step 1: K, V
          {"layer", f.projections(f.layer_base - f.kv_base, f.layer_adapters - f.kv_adapters, true) +
                        f.attention * (1 + FlopTerms::kAttentionBackward)},  // step 2, its attention too
          {"kv_path", f.projections(f.kv_base, f.kv_adapters, true)}};     // step 3
}

double streambp_flops(const Workload& w, std::int64_t head_chunk) {
  double sum = 0;
  for (const auto& p : streambp_phase_flops(w, head_chunk)) sum += p.flops;
  return sum;
}

double streambp_layer_backward_flops(const Workload& w) {
  double steps = 0;  // steps 1-3
  for (const auto& p : streambp_phase_flops(w))
    if (p.name == "kv_recompute" || p.name == "layer" || p.name == "kv_path") steps += p.flops;
  return steps / double(std::max<std::int64_t>(1, w.config.num_hidden_layers));
}

}  // namespace sbp
