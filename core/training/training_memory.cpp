#include "core/training/training_memory.h"

#include <algorithm>
#include <string>

#include "core/methods/memory_terms.h"

namespace sbp {

using namespace memory;

namespace {

// The largest moment of the BP and the update, on the device.
MemoryEstimate device_peak(const BackpropMethod& method, const Workload& w) {
  auto bp = method.memory_model(w);
  const Sizes z(w);
  // On the device unless they are in the offload tier.
  const auto states = w.offloads(OffloadKind::optimizer) ? 0 : w.optimizer_state_bytes;
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
  // its slices (stage 3).
  bp.terms.push_back({"optimizer states", states});
  // After the last micro-batch: every gradient exists (clipped in place), the activations are gone.
  MemoryEstimate update{"optimizer step",
                        {{"weights", z.rest_weights},
                         {"gradients", z.step_gradients()},
                         {"optimizer states", states},
                         {"the update's temporaries", w.optimizer_update_bytes}}};
  if (!w.data_parallel() || w.zero_stage() == 0) return largest({bp, update});
  // ZeRO 1-3, around the update (DataParallel): the gradient norm summed over the ranks' slices in fp64 (each slice's
  // gradient converted, unless fp64 already, and squared: two [slice] fp64 temporaries of the longest slice); after
  // it (stages 1-2), each group's updated slices all-gathered: this rank's [slice] packed, the [N, slice] result and
  // the backend's copy of it (collective_copies). Both with every gradient and state still alive.
  const auto longest_slice = (z.largest_tensor + z.N - 1) / z.N;
  MemoryEstimate norm{"gradient norm (fp64, over the slices)",
                      {{"weights", z.rest_weights},
                       {"gradients", z.step_gradients()},
                       {"optimizer states", states},
                       {"fp64 copy and square of the longest slice's gradient",
                        (z.g == 8 ? 1 : 2) * 8 * longest_slice}}};
  if (z.sharded_parameters()) return largest({bp, update, norm});  // the slices are the parameters: no gather
  const auto largest_group = std::max({z.head_group, z.layer_grad, z.embedding_group});
  MemoryEstimate gather{"all-gather of the updated slices",
                        {{"weights", z.rest_weights},
                         {"gradients", z.step_gradients()},
                         {"optimizer states", states},
                         {std::string("the largest group's slice, gathered [N, slice]") +
                              (w.collective_copies() ? " and the backend's copy" : ""),
                          (z.N + 1 + (w.collective_copies() ? z.N : 0)) * z.slice_elements(largest_group) * z.g}}};
  return largest({bp, update, norm, gather});
}

}  // namespace

MemoryEstimate training_memory(const BackpropMethod& method, const Workload& w) {
  auto peak = device_peak(method, w);
  // The offload tier's peak: the BP's (its checkpoints at the end of the forward) beside the states, which live there
  // the whole step.
  peak.host = method.memory_model(w).host;
  if (w.offloads(OffloadKind::optimizer) && w.optimizer_state_bytes > 0) peak.host.push_back({"optimizer states", w.optimizer_state_bytes});
  return peak;
}

}  // namespace sbp
