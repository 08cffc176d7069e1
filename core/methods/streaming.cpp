#include "core/methods/streaming.h"

#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include "core/model/kv_source.h"
#include "core/model/model.h"
#include "core/objectives/objective.h"
#include "core/methods/phase.h"

namespace sbp {

void for_each_rank_chunk(const Model& model, std::int64_t T, std::int64_t c,
                         const std::function<void(std::int64_t s, std::int64_t e, std::int64_t position)>& f) {
  model.kv_source().for_each_chunk(T, c, f);
}

at::Tensor kv_chunked(const Model& model, int layer, const at::Tensor& h, std::int64_t chunk) {
  at::NoGradGuard no_grad;
  at::Tensor KV;  // [2, B, n_kv, t, hd]
  for_each_rank_chunk(model, h.size(1), chunk, [&](std::int64_t s, std::int64_t e, std::int64_t position) {
    const auto kv = model.kv(layer, h.slice(1, s, e), position);
    if (!KV.defined()) {
      auto sizes = kv.first.sizes().vec();
      sizes[2] = h.size(1);
      sizes.insert(sizes.begin(), 2);
      KV = at::empty(sizes, kv.first.options());
    }
    KV[0].slice(2, s, e).copy_(kv.first);
    KV[1].slice(2, s, e).copy_(kv.second);
  });
  return KV;
}

namespace {

// A layer's chunked forward around attention, for the model's K/V source (kv_source.h).
class ChunkedLayerForward final : public StreamedForward {
 public:
  ChunkedLayerForward(const Model& model, int layer, const at::Tensor& h) : model_(model), layer_(layer), h_(h) {}
  void chunk(const ChunkRows& r, const at::Tensor& K, const at::Tensor& V) override {
    const auto hc = h_.slice(1, r.s, r.e);
    const auto keys = r.position + r.length();  // the prefix [0, position + c)
    const auto o = model_.attend(model_.q(layer_, hc, r.position), K.slice(2, 0, keys), V.slice(2, 0, keys), r.position);
    rows(r).copy_(model_.after_attention(layer_, hc, o));
  }
  at::Tensor q(const ChunkRows& r) override { return model_.q(layer_, h_.slice(1, r.s, r.e), r.position); }
  void output(const ChunkRows& r, const at::Tensor& o) override {  // o: [B, n_h, c, hd]
    const auto hc = h_.slice(1, r.s, r.e);
    rows(r).copy_(model_.after_attention(layer_, hc, attention_rows(o)));
  }
  at::Tensor take() { return std::move(out_); }

 private:
  // The output's rows; made at the first chunk, once the source has the keys (an exchange's buffers gone).
  at::Tensor rows(const ChunkRows& r) {
    if (!out_.defined()) out_ = at::empty_like(h_);
    return out_.slice(1, r.s, r.e);
  }

  const Model& model_;
  int layer_;
  const at::Tensor& h_;
  at::Tensor out_;  // [B, T, d]
};

}  // namespace

at::Tensor attention_rows(const at::Tensor& o) {
  return o.transpose(1, 2).reshape({o.size(0), o.size(2), o.size(1) * o.size(3)});
}

at::Tensor layer_forward_chunked(const Model& model, int layer, const at::Tensor& h, std::int64_t layer_chunk) {
  at::NoGradGuard no_grad;
  ChunkedLayerForward pieces(model, layer, h);
  model.kv_source().stream_forward(kv_chunked(model, layer, h, layer_chunk), layer_chunk, model.attention_rule(),
                                   pieces);
  return pieces.take();
}

PreparedObjective statistics_pass(const Model& model, const PreparedObjective& objective, const at::Tensor& h_last,
                                  std::int64_t head_chunk) {
  at::NoGradGuard no_grad;
  StatisticsPass statistics(objective);
  for_each_rank_chunk(model, h_last.size(1), head_chunk, [&](std::int64_t s, std::int64_t e, std::int64_t position) {
    auto logits = model.logits(model.final_norm(h_last.slice(1, s, e)));  // [B, c_h, V]
    statistics.add(logits, position);
  });
  auto& source = model.kv_source();
  return statistics.finish([&](at::Tensor& s) { source.sum_over_group(s); });
}

HeadResult streamed_head(const Model& model, const PreparedObjective& prepared, const at::Tensor& h_last,
                         std::int64_t head_chunk, PhaseClock& clock) {
  const auto T = h_last.size(1);
  // Objectives whose loss couples positions (DPO's per-row sums) need their statistics before a head chunk that is
  // not the whole sequence.
  auto objective = prepared;
  if (prepared.needs_statistics() && !model.kv_source().chunk_holds_sequence(T, head_chunk)) {
    Phase phase(clock, "statistics");
    objective = statistics_pass(model, prepared, h_last, head_chunk);
  }
  HeadResult out;
  out.grad = at::zeros_like(h_last);
  Phase phase(clock, "head");
  // The head's trainable parameters: the final norm weight through autograd, the lm_head weight by hand (its
  // gradient is one GEMM per chunk into `lm_sum`, fp32 for a bf16 model); both committed once after the last chunk.
  std::vector<at::Tensor> norm;
  if (model.final_norm_weight().requires_grad()) norm.push_back(model.final_norm_weight());
  ChunkGradients norm_grads(norm);
  at::Tensor lm_sum;  // [V, d]
  Model::HeadBuffers buffers;  // the [B, c_h, V] blocks every chunk reuses (see Model::HeadBuffers)
  for_each_rank_chunk(model, T, head_chunk, [&](std::int64_t s, std::int64_t e, std::int64_t position) {
    auto h = h_last.slice(1, s, e).detach().requires_grad_(true);  // [B, c_h, d]
    const auto hn = model.final_norm(h);                              // with a graph: final norm weight and h
    at::Tensor logits;  // [B, c_h, V], compute dtype; becomes dLoss/dlogits
    {
      at::NoGradGuard no_grad;
      logits = model.logits(hn, &buffers);
    }
    out.loss += objective.chunk_loss_and_grad(logits, position);
    const auto grad_hn = model.logits_backward(logits, hn, lm_sum, &buffers);  // [B, c_h, d]
    logits.reset();  // a view: the block stays for the next chunk, through the final norm's backward
    std::vector<at::Tensor> inputs = {h};
    inputs.insert(inputs.end(), norm.begin(), norm.end());
    const auto grads = torch::autograd::grad({hn}, inputs, {grad_hn}, /*retain_graph=*/false, /*create_graph=*/false,
                                             /*allow_unused=*/true);
    out.grad.slice(1, s, e).copy_(grads[0]);
    norm_grads.add(at::ArrayRef<at::Tensor>(grads).slice(1));
  });
  buffers = {};  // before the commits (bf16: the lm_head's fp32 sum is rounded into a new block)
  norm_grads.commit();
  model.commit_lm_head_gradient(lm_sum);
  return out;
}

at::Tensor sequence_logps(const Model& model, const at::Tensor& input_ids, double temperature,
                          std::int64_t layer_chunk, std::int64_t head_chunk) {
  at::NoGradGuard no_grad;
  auto h = model.embed(input_ids);  // [B, T, d]
  for (int l = 0; l < model.config().num_hidden_layers; ++l) h = layer_forward_chunked(model, l, h, layer_chunk);
  const auto B = input_ids.size(0), T = input_ids.size(1);
  auto out = at::zeros({B, T}, input_ids.options().dtype(at::kDouble));
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

at::Tensor sequence_logps(const Model& model, const Batch& batch, double temperature, std::int64_t layer_chunk,
                          std::int64_t head_chunk) {
  const Model::PackedRowsInUse packed(model, batch.packed.get());
  return sequence_logps(model, batch.input_ids, temperature, layer_chunk, head_chunk);
}

}  // namespace sbp
