#include "core/method.h"

#include "core/model.h"

namespace sbp {

StepResult BackpropMethod::step(Model& model, Objective& objective, const Batch& batch, const StepOptions& options) {
  if (!options.accumulate) model.zero_grad();
  objective.prepare(batch, model.config());
  PhaseClock clock;
  const auto start = std::chrono::steady_clock::now();
  const double loss = backprop(model, objective, batch, clock);
  return StepResult::finish(loss, start, clock, model.device());
}

}  // namespace sbp
