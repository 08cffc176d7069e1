// HF-style per-layer gradient checkpointing: the forward keeps only each layer's input; the backward re-forwards
// one layer on the full sequence and back-propagates it. Full-sequence fp32 logits and their gradient (the
// paper's Figure 1). LibTorch has no C++ checkpoint utility, so the re-forward is written out here.
#pragma once

#include "core/methods/flop_model.h"
#include "core/methods/method.h"

namespace sbp {

class CheckpointBackprop final : public BackpropMethod {
 public:
  std::string spec() const override { return "checkpoint"; }
  bool keeps_layer_checkpoints() const override { return true; }
  bool runs_sequence_shards() const override { return true; }
  MemoryEstimate memory_model(const Workload& workload) const override;
  double flops(const Workload& workload) const override { return checkpoint_flops(workload); }
 private:
  double backprop(Model& model, const PreparedObjective& objective, const Batch& batch, PhaseClock& clock) override;
};

struct MethodEntry;
MethodEntry checkpoint_entry();  // its entry in the catalogue (baselines/methods.h)

}  // namespace sbp
