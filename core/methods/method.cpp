#include "core/methods/method.h"

#include "core/model/model.h"

namespace sbp {

StepResult BackpropMethod::step(Model& model, Objective& objective, const Batch& batch, const StepOptions& options) {
  if (!options.accumulate) model.zero_grad();
  objective.prepare(batch, model.config());
  PhaseClock clock;
  const auto start = std::chrono::steady_clock::now();
  const double loss = backprop(model, objective, batch, clock);
  return StepResult::finish(loss, start, clock, model.device());
}

void BackpropMethod::gradient_ready(std::string name, std::vector<at::Tensor> tensors) const {
  if (gradient_ready_ && !tensors.empty()) gradient_ready_({std::move(name), std::move(tensors)});
}

void BackpropMethod::layer_ready(const Model& model, int layer) const {
  if (gradient_ready_) gradient_ready("layer." + std::to_string(layer), model.layer_trainable(layer));
}

void BackpropMethod::head_ready(const Model& model) const {
  if (gradient_ready_) gradient_ready("head", model.head_trainable());
}

void BackpropMethod::embedding_ready(const Model& model) const {
  if (gradient_ready_) gradient_ready("embedding", model.embedding_trainable());
}

}  // namespace sbp
