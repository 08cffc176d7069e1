// MsT, the Mini-Sequence Transformer (Luo et al. 2024), as its paper describes it: per-layer
// checkpointing, with the LM head + loss and each layer's MLP processed in M mini-sequences of ceil(T / M)
// positions; attention runs on the full sequence. In the re-forward of a layer an MLP mini-sequence keeps only its
// input and is back-propagated before the next one is formed, so at most one mini-sequence's MLP intermediates exist
// (the public code's plain loop under autograd keeps all of them, which under checkpointing saves nothing).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "core/methods/flop_model.h"
#include "core/methods/method.h"
#include "core/methods/phase.h"

namespace sbp {

struct HeadResult;
// Not final: the negative controls' faulty subclass (tests/support/faulty_methods.h) overrides head_and_loss.
class MsT : public BackpropMethod {
 public:
  struct Options {
    std::int64_t mini_seq = 64;  // M: mini-sequences per sequence (the public code's default for the head)
  };

  explicit MsT(Options options) : options_(options) {}
  // Positions per mini-sequence: M mini-sequences of ceil(T / M) positions, the last one shorter.
  static std::int64_t mini_sequence_length(std::int64_t T, std::int64_t M) { return (T + M - 1) / M; }
  std::string spec() const override { return "mst:mini_seq=" + std::to_string(options_.mini_seq); }
  bool keeps_layer_checkpoints() const override { return true; }
  MemoryEstimate memory_model(const Workload& workload) const override;
  double flops(const Workload& workload) const override { return mst_flops(workload); }

 protected:
  const Options& options() const { return options_; }
  // The LM head + loss in mini-sequences of `chunk` positions (streamed_head): the loss and dLoss/dH[L]; commits the
  // head's gradients.
  virtual HeadResult head_and_loss(const Model& model, const PreparedObjective& objective, const at::Tensor& h_last,
                                   std::int64_t chunk, PhaseClock& clock) const;

 private:
  double backprop(Model& model, const PreparedObjective& objective, const Batch& batch, PhaseClock& clock) override;
  // Re-forward of one layer with the MLP in mini-sequences; returns dLoss/dH_in given H_in and dLoss/dH_out.
  at::Tensor layer_backward(const Model& model, int layer, const at::Tensor& h_in, const at::Tensor& g_out,
                            std::int64_t chunk, PhaseClock& clock) const;

  Options options_;
};

struct MethodEntry;
MethodEntry mst_entry();  // its entry in the catalogue (baselines/methods.h)

}  // namespace sbp
