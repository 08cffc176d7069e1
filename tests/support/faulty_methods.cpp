#include "tests/support/faulty_methods.h"

#include <algorithm>
#include <stdexcept>

#include <ATen/ATen.h>

#include "core/methods/streaming.h"
#include "core/model/chunk_attention.h"
#include "core/model/model.h"

namespace sbp::test {

at::Tensor TopLeftCausalStreamBP::attend(const Model& model, const at::Tensor& q, const at::Tensor& K,
                                         const at::Tensor& V, std::int64_t, const KVGradSums& sums) const {
  const auto c = q.size(2);
  return model.attend(q, K.slice(2, 0, c), V.slice(2, 0, c), 0, &sums);
}

HeadResult DoubledHeadGradStreamBP::head_and_loss(const Model& model, const PreparedObjective& objective, const at::Tensor& h_last,
                                                  PhaseClock& clock) const {
  auto out = StreamBP::head_and_loss(model, objective, h_last, clock);
  // Doubling what the head made of dLoss/dlogits is doubling dLoss/dlogits: scaling by 2 is exact in floating point.
  // The head's gradients held nothing before this step (the negative controls do not accumulate); tied, the lm_head
  // gradient holds only the head's share here (the embedding's comes later).
  out.grad.mul_(2.0);
  for (const auto& weight : {model.final_norm_weight(), model.lm_head_weight()})
    if (weight.grad().defined()) weight.mutable_grad().mul_(2.0);
  return out;
}

void DroppedTailStreamBP::stream_layer_backward(const Model& model, int layer, const at::Tensor& h_in, at::Tensor& g,
                                                PhaseClock& clock) const {
  const auto T = h_in.size(1), c = options().layer_chunk;
  const auto T_used = T - T % c;
  // The forgotten rows get no input gradient; the others get the exact backward of the first T_used tokens, which
  // is what the full chunks alone compute (no query of them sees a later key).
  g.slice(1, T_used).zero_();
  if (T_used == 0) return;
  auto g_used = g.slice(1, 0, T_used);  // a view: the backward writes into g
  StreamBP::stream_layer_backward(model, layer, h_in.slice(1, 0, T_used), g_used, clock);
}

std::unique_ptr<StreamBP> make_streambp(StreamBPFault fault, StreamBP::Options options) {
  switch (fault) {
    case StreamBPFault::none: return std::make_unique<StreamBP>(options);
    case StreamBPFault::top_left_causal: return std::make_unique<TopLeftCausalStreamBP>(options);
    case StreamBPFault::drop_kv_path: return std::make_unique<NoKvPathStreamBP>(options);
    case StreamBPFault::double_head_grad: return std::make_unique<DoubledHeadGradStreamBP>(options);
    case StreamBPFault::drop_tail: return std::make_unique<DroppedTailStreamBP>(options);
    case StreamBPFault::accumulate_in_model_dtype: return std::make_unique<ModelDtypeSumsStreamBP>(options);
  }
  throw std::logic_error("make_streambp: unknown fault");
}

HeadResult DoubledLmHeadGradMsT::head_and_loss(const Model& model, const PreparedObjective& objective, const at::Tensor& h_last,
                                               std::int64_t chunk, PhaseClock& clock) const {
  auto out = MsT::head_and_loss(model, objective, h_last, chunk, clock);
  model.lm_head_weight().mutable_grad().mul_(2.0);
  return out;
}

HeadResult DroppedTailMsT::head_and_loss(const Model& model, const PreparedObjective& objective, const at::Tensor& h_last,
                                         std::int64_t, PhaseClock& clock) const {
  const auto T = h_last.size(1), M = options().mini_seq;
  const auto slice = std::max<std::int64_t>(1, (T - 1) / M);
  const auto T_used = std::min(T, slice * M);
  // The head over the slices' positions only; the rest keep a zero gradient. (Under SFT, the only objective the
  // public code has, nothing else depends on them; an objective with a row term would also lose them from its
  // statistics pass.)
  auto out = MsT::head_and_loss(model, objective, h_last.slice(1, 0, T_used), slice, clock);
  auto grad = at::zeros_like(h_last);
  grad.slice(1, 0, T_used).copy_(out.grad);
  out.grad = grad;
  return out;
}

std::unique_ptr<MsT> make_mst(MsTFault fault, MsT::Options options) {
  switch (fault) {
    case MsTFault::none: return std::make_unique<MsT>(options);
    case MsTFault::double_head_grad: return std::make_unique<DoubledLmHeadGradMsT>(options);
    case MsTFault::drop_tail: return std::make_unique<DroppedTailMsT>(options);
  }
  throw std::logic_error("make_mst: unknown fault");
}

}  // namespace sbp::test
