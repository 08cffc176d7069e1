#include "baselines/standard.h"

#include <ATen/ATen.h>

#include "core/memory_model.h"
#include "core/model.h"

namespace sbp {

StepResult StandardBackprop::step(Model& model, Objective& objective, const Batch& batch) {
  model.zero_grad();
  objective.prepare(batch, model.config());
  PhaseClock clock;
  const auto start = std::chrono::steady_clock::now();
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
  return StepResult::finish(loss.item<double>(), start, clock, model.device());
}

MemoryEstimate StandardBackprop::memory_model(const Workload& w) const { return standard_memory(w); }

}  // namespace sbp
