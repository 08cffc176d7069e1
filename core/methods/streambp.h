// StreamBP (Luo et al. 2025): exact backpropagation streamed along the sequence, layer by layer (DESIGN §4).
// Memory: weights + gradients + one [B, T, d] checkpoint per layer + one layer's K/V and their gradients + the
// working set of one layer chunk and of one head chunk; never a [T, T] tile, never full-T logits.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "core/methods/flop_model.h"
#include "core/methods/method.h"

namespace sbp {

struct KVGradSums;
class StreamBP final : public BackpropMethod {
 public:
  struct Options {
    std::int64_t layer_chunk = 512;  // tokens per chunk inside a decoder layer (c)
    std::int64_t head_chunk = 1024;  // tokens per chunk of the LM head + loss (c_h)
  };
  // Deliberate bugs for the negative controls of the exactness gate (tests only; all off in every other use).
  struct Faults {
    bool top_left_causal = false;  // SDPA's is_causal on [s, e) x [0, e): the classic chunking bug
    bool drop_kv_path = false;     // skip step 3: dK/dV never reach W_k, W_v and the layer input
    bool double_head_grad = false; // back-propagate 2x the head gradient
    // Forget the last T mod c tokens of every layer's backward. Under SFT it only shows when T mod c >= 2: the
    // last token predicts nothing and no query attends to it, so its own gradient is exactly zero anyway.
    bool drop_tail = false;
    // Sum dK/dV and the layer's weight gradients over chunks in the model dtype (bf16): one rounding per chunk.
    bool accumulate_in_model_dtype = false;
  };

  explicit StreamBP(Options options) : options_(options) {}
  std::string spec() const override;
  MemoryEstimate memory_model(const Workload& workload) const override;
  double flops(const Workload& workload) const override { return streambp_flops(workload, options_.layer_chunk); }
  void inject_faults_for_testing(const Faults& faults) { faults_ = faults; }

 private:
  double backprop(Model& model, Objective& objective, const Batch& batch, PhaseClock& clock) override;
  // One layer's exact backward, streamed: g holds dLoss/dH_out [B, T, d] on entry and dLoss/dH_in on return. Each
  // chunk reads its own rows of dLoss/dH_out once (the layer is position-wise outside attention, whose K/V
  // gradients go to the sums), so its input gradient overwrites them: no second [B, T, d] buffer.
  void stream_layer_backward(const Model& model, int layer, const at::Tensor& h_in, at::Tensor& g,
                             PhaseClock& clock) const;
  // The chunk's attention over K/V[..., :q_start + c, :], its K/V gradients added into `sums`.
  at::Tensor attend(const Model& model, const at::Tensor& q, const at::Tensor& K, const at::Tensor& V,
                    std::int64_t q_start, const KVGradSums& sums) const;

  Options options_;
  Faults faults_;
};

}  // namespace sbp
