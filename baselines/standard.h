// Standard backprop: one autograd graph over the whole model and the full-sequence fp32 logits (HF without
// checkpointing). The reference every other method is checked against.
#pragma once

#include "core/methods/flop_model.h"
#include "core/methods/method.h"

namespace sbp {

class StandardBackprop final : public BackpropMethod {
 public:
  std::string spec() const override { return "standard"; }
  bool runs_sequence_shards() const override { return true; }
  MemoryEstimate memory_model(const Workload& workload) const override;
  double flops(const Workload& workload) const override { return standard_flops(workload); }
 private:
  double backprop(Model& model, const PreparedObjective& objective, const Batch& batch, PhaseClock& clock) override;
};

struct MethodEntry;
MethodEntry standard_entry();  // its entry in the catalogue (baselines/methods.h)

}  // namespace sbp
