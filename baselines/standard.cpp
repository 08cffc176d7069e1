#include "baselines/standard.h"

#include <ATen/ATen.h>

#include "core/methods/memory_model.h"
#include "core/model/model.h"

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
  // One graph: every gradient is final only when backward() returns (autograd's post-accumulate hooks would fire
  // earlier per tensor; the groups fire here, in the streamed methods' order).
  head_ready(model);
  for (int l = model.config().num_hidden_layers - 1; l >= 0; --l) layer_ready(model, l);
  embedding_ready(model);
  return loss.item<double>();
}

MemoryEstimate StandardBackprop::memory_model(const Workload& w) const { return standard_memory(w); }

}  // namespace sbp
