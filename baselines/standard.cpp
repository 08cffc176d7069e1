#include "baselines/standard.h"

#include <ATen/ATen.h>

#include "core/memory_model.h"
#include "core/model.h"

namespace sbp {

double StandardBackprop::backprop(Model& model, Objective& objective, const Batch& batch, PhaseClock& clock) {
  at::Tensor loss;
  {
    Phase phase(clock, "forward");
    auto h = model.embed(batch.input_ids);  // [B, T, d]
    for (int l = 0; l < model.config().num_hidden_layers; ++l) h = model.layer_forward(l, h);
    loss = objective.chunk_loss(model.logits(model.final_norm(h)), 0);
  }
  {
    Phase phase(clock, "backward");
    loss.backward();
  }
  return loss.item<double>();
}

MemoryEstimate StandardBackprop::memory_model(const Workload& w) const { return standard_memory(w); }

}  // namespace sbp
