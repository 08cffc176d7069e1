// Faulty BP methods for the negative controls (ARCHITECTURE.md §8): each subclass overrides one protected step of StreamBP or
// MsT with a classic way of getting a streamed backward wrong, so that the tests can show that the gates fail on it.
// The production classes carry no switch for any of them: fault injection lives in tests.
#pragma once

#include <memory>

#include "baselines/mst.h"
#include "core/methods/streambp.h"

namespace sbp::test {

// SDPA's is_causal on [s, s+c) x [0, s+c) aligns top-left: query i sees keys 0..i, as if the chunk started at 0.
// The classic chunking bug; it needs a chunk with s > 0 to show.
class TopLeftCausalStreamBP : public StreamBP {
 public:
  using StreamBP::StreamBP;

 protected:
  at::Tensor attend(const Model& model, const at::Tensor& q, const at::Tensor& K, const at::Tensor& V,
                    std::int64_t q_start, const KVGradSums& sums) const override;
};

// Skips step 3: dK/dV never reach W_k, W_v and the layer input.
class NoKvPathStreamBP : public StreamBP {
 public:
  using StreamBP::StreamBP;

 protected:
  void kv_path_backward(const Model&, int, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&,
                        ChunkGradients&, PhaseClock&) const override {}
};

// Back-propagates 2x the head gradient (dLoss/dlogits): the lm_head, final-norm and every layer's gradients double;
// the loss does not.
class DoubledHeadGradStreamBP : public StreamBP {
 public:
  using StreamBP::StreamBP;

 protected:
  HeadResult head_and_loss(const Model& model, const PreparedObjective& objective, const at::Tensor& h_last,
                           PhaseClock& clock) const override;
};

// Forgets the last T mod c tokens of every layer's backward, like a loop over T / c full chunks would. Under SFT it
// only shows when T mod c >= 2: the last token predicts nothing and no query attends to it, so its own gradient is
// exactly zero anyway.
class DroppedTailStreamBP : public StreamBP {
 public:
  using StreamBP::StreamBP;

 protected:
  void stream_layer_backward(const Model& model, int layer, const at::Tensor& h_in, at::Tensor& g,
                             PhaseClock& clock) const override;
};

// Sums dK/dV and the layer's weight gradients over chunks in the model dtype (bf16): one rounding per chunk.
class ModelDtypeSumsStreamBP : public StreamBP {
 public:
  using StreamBP::StreamBP;

 protected:
  c10::ScalarType accumulation_dtype(c10::ScalarType dtype) const override { return dtype; }
};

// The faults above by name, for the tests that sweep over them; none: the correct StreamBP.
enum class StreamBPFault {
  none, top_left_causal, drop_kv_path, double_head_grad, drop_tail, accumulate_in_model_dtype
};
std::unique_ptr<StreamBP> make_streambp(StreamBPFault fault, StreamBP::Options options);

// The public MsT code's bug A: its custom backward hands back the weight's own .grad, so the lm_head gradient
// doubles (the layers' do not).
class DoubledLmHeadGradMsT : public MsT {
 public:
  using MsT::MsT;

 protected:
  HeadResult head_and_loss(const Model& model, const PreparedObjective& objective, const at::Tensor& h_last, std::int64_t chunk,
                           PhaseClock& clock) const override;
};

// The public MsT code's bug B: the head runs M slices of floor((T-1)/M) shifted targets each, so the last
// (T-1) mod M positions get no gradient.
class DroppedTailMsT : public MsT {
 public:
  using MsT::MsT;

 protected:
  HeadResult head_and_loss(const Model& model, const PreparedObjective& objective, const at::Tensor& h_last, std::int64_t chunk,
                           PhaseClock& clock) const override;
};

enum class MsTFault { none, double_head_grad, drop_tail };
std::unique_ptr<MsT> make_mst(MsTFault fault, MsT::Options options);

}  // namespace sbp::test
