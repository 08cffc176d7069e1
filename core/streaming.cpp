#include "core/streaming.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "core/model.h"
#include "core/objective.h"

namespace sbp {

at::Tensor layer_forward_chunked(const Model& model, int layer, const at::Tensor& h, std::int64_t layer_chunk) {
  at::NoGradGuard no_grad;
  const auto [K, V] = model.kv(layer, h, 0);  // [B, n_kv, T, hd]
  auto out = at::empty_like(h);
  for_each_chunk(h.size(1), layer_chunk, [&](std::int64_t s, std::int64_t e) {
    const auto hc = h.slice(1, s, e);
    const auto o = model.attend(model.q(layer, hc, s), K.slice(2, 0, e), V.slice(2, 0, e), s);
    out.slice(1, s, e).copy_(model.after_attention(layer, hc, o));
  });
  return out;
}

void statistics_pass(const Model& model, Objective& objective, const at::Tensor& h_last, std::int64_t head_chunk) {
  at::NoGradGuard no_grad;
  for_each_chunk(h_last.size(1), head_chunk, [&](std::int64_t s, std::int64_t e) {
    auto logits = model.logits(model.final_norm(h_last.slice(1, s, e)));  // [B, c_h, V]
    objective.accumulate_statistics(logits, s);
  });
  objective.finish_statistics();
}

at::Tensor sequence_logps(const Model& model, const at::Tensor& input_ids, double temperature,
                          std::int64_t layer_chunk, std::int64_t head_chunk) {
  at::NoGradGuard no_grad;
  auto h = model.embed(input_ids);  // [B, T, d]
  for (int l = 0; l < model.config().num_hidden_layers; ++l) h = layer_forward_chunked(model, l, h, layer_chunk);
  const auto B = input_ids.size(0), T = input_ids.size(1);
  auto out = at::zeros({B, T}, at::kDouble);
  // Position t predicts token t + 1: positions [s, e) fill columns [s + 1, e + 1); the last position predicts nothing.
  for_each_chunk(T - 1, head_chunk, [&](std::int64_t s, std::int64_t e) {
    auto logits = model.logits(model.final_norm(h.slice(1, s, e)));  // [B, c_h, V]
    if (temperature != 1.0) logits.div_(temperature);
    const auto targets = input_ids.slice(1, s + 1, e + 1).unsqueeze(-1);
    const auto lse = at::logsumexp(logits, -1);
    out.slice(1, s + 1, e + 1).copy_(logits.gather(-1, targets).squeeze(-1) - lse);
  });
  return out;
}

}  // namespace sbp
