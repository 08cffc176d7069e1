#include "core/training/training_memory.h"

#include "core/methods/memory_terms.h"

namespace sbp {

using namespace memory;

MemoryEstimate training_memory(const BackpropMethod& method, const Workload& w) {
  auto bp = method.memory_model(w);
  // The offload tier's peak: the BP's (its checkpoints at the end of the forward), with what the features keep there
  // the whole step beside it (the optimizer's states).
  const auto host = bp.host;
  const Sizes z(w);
  // Not modelled moment by moment: a later micro-batch's BP beside the gradients the earlier ones left (each
  // method's moments count only the gradients that exist by then). An upper bound: all of them on top (measured on
  // tiny, T = 64: 12-17% above the single-batch model, which the bound covers).
  if (w.accumulating) {
    bp.moment += " (upper bound: a later micro-batch)";
    bp.terms.push_back({"gradients of the earlier micro-batches", z.all_gradients});
  }
  if (w.optimizer_state_bytes == 0 && w.optimizer_update_bytes == 0) return bp;
  // Data-parallel (ZeRO 1-3): the states are this rank's slices' (add_optimizer_memory), the update's temporaries
  // those of its longest slice, the gradients after the events its slices (stages 2-3), the weights between steps
  // its slices (stage 3). On the device unless they are in the offload tier.
  bp.terms.push_back({"optimizer states", z.device_optimizer_states});
  // After the last micro-batch: every gradient exists (clipped in place), the activations are gone.
  MemoryEstimate update{"optimizer step",
                        {{"weights", z.rest_weights},
                         {"gradients", z.step_gradients()},
                         {"optimizer states", z.device_optimizer_states},
                         {"the update's temporaries", w.optimizer_update_bytes}}};
  StepMoments step{{bp, update}, host};
  add_feature_step_moments(w, step);
  auto peak = largest(std::move(step.moments));
  peak.host = std::move(step.host);
  return peak;
}

}  // namespace sbp
