// What data parallelism adds to every method's memory model (ARCHITECTURE.md §12), through DataParallelism's hooks
// (workload.h): its share of the sizes, its moments beside the method's, and the training step's around the update.
// They live with the methods' models, not with DataParallel (core/training), because each method's own moments are
// written in them: which gradients are reduced while layer l runs, which layer is gathered (memory_terms.h's Sizes).
#include <algorithm>
#include <string>
#include <vector>

#include "core/methods/memory_terms.h"

namespace sbp::memory {
namespace {

// Data parallelism (ARCHITECTURE.md §12): each group's collective at its gradient-ready event (DataParallel::reduce), with
// what is alive then. Streamed methods and checkpointing fire the events between their layers: the checkpoints of
// the layers below (the layer's own was freed before its event), dL/dH, the gradients of the groups before (reduced)
// and of this group; standard BP fires them all after its backward, when only gradients are left, every group not
// yet reduced in full. The first and last layer's events stand for every layer's (the sum is linear in l).
std::vector<MemoryEstimate> gradient_event_moments(const Workload& w, bool streamed) {
  const Sizes z(w);
  if (z.N == 1) return {};
  const auto btd = z.B * z.T * z.d * z.s;
  std::vector<MemoryEstimate> out;
  const auto event = [&](const std::string& group, std::int64_t group_bytes, std::int64_t checkpoints,
                         std::int64_t gradients) {
    if (group_bytes == 0) return;  // no trainable tensor: no event
    out.push_back({group + " gradient reduction",
                   {{"weights", z.weights},
                    {"checkpoints", streamed ? checkpoints : 0},
                    {"dL/dH", streamed ? btd : 0},
                    {"gradients (the groups before reduced, this one's full)", gradients},
                    {z.sharded_gradients() ? std::string("reduce-scatter buffers ([N, slice], its slice") +
                                                 (z.collective_copies ? ", the backend's copy)" : ")")
                                           : std::string("all-reduce buffer (the group's gradients flattened)"),
                     z.reduction_buffers(group_bytes, z.collective_copies)},
                    {"objective buffers", objective_bytes(w)}}});
  };
  // Standard BP: the groups after this one still full (the layers below, an untied embedding).
  const auto untied_embedding = z.tied ? 0 : z.embedding_group;
  // The checkpoints on the device (Sizes::checkpoints: with offload, the one in use and the one fetched ahead).
  event("head", z.head_group, z.checkpoints(z.L), streamed ? z.head_gradients : z.all_gradients);
  for (const auto l : {z.L - 1, std::int64_t(0)}) {
    const auto gradients = streamed ? z.layer_gradients_at(l)
                                    : z.head_after() + (z.L - 1 - l) * z.reduced(z.layer_grad) +
                                          (l + 1) * z.layer_grad + untied_embedding;
    event("layer " + std::to_string(l), z.layer_grad, z.checkpoints(l), gradients);
    if (z.L == 1) break;
  }
  event("embedding", z.embedding_group, 0, z.embedding_backward_gradients());
  return out;
}

}  // namespace

// ZeRO-3 (DataParallel::use): the embedding and head gathered at the step's start, when only the slices, the states
// and the batch exist; a layer gathered where its backward starts, beside what its backward moment holds but its
// gradients and activations (the forward's gathers hold less: no gradients, fewer checkpoints). Standard BP gathers
// inside autograd's backward; its moments count every layer gathered at the end instead (standard_memory).
std::vector<MemoryEstimate> parameter_gather_moments(const Workload& w, bool streamed) {
  const Sizes z(w);
  if (!z.parameters_leave()) return {};
  const auto btd = z.B * z.T * z.d * z.s;
  std::vector<MemoryEstimate> out;
  if (z.embedding_group + z.head_group > 0)
    out.push_back({"embedding and head parameter gather (step start)",
                   {{"weights (the slices)", z.rest_weights},
                    {"gather buffers", z.gather_buffers(z.embedding_group + z.head_group, z.collective_copies)},
                    {"objective buffers", objective_bytes(w)}}});
  if (!streamed) return out;
  for (const auto& state : layer_states(z))
    out.push_back({"layer " + std::to_string(state.layer) + " parameter gather (backward)",
                   {{"weights", z.weights},
                    {"checkpoints", state.checkpoints},
                    {"dL/dH", btd},
                    {"gradients (of the head and the layers after)", state.gradients - z.layer_grad},
                    {"gather buffers", z.gather_buffers(z.layer_grad, z.collective_copies)},
                    {"objective buffers", objective_bytes(w)}}});
  return out;
}

}  // namespace sbp::memory

namespace sbp {

using namespace memory;

void DataParallelism::size(Sizes& z) const {
  z.N = world_size;
  z.stage = zero_stage;
  z.collective_copies = collective_copies;
}

// Its collectives at the gradient-ready events, then ZeRO-3's gathers.
void DataParallelism::add_moments(const Workload& w, bool streamed, std::vector<MemoryEstimate>& moments) const {
  for (auto& m : gradient_event_moments(w, streamed)) moments.push_back(std::move(m));
  if (Sizes(w).sharded_parameters())
    for (auto& m : parameter_gather_moments(w, streamed)) moments.push_back(std::move(m));
}

// ZeRO 1-3, around the update (DataParallel): the gradient norm summed over the ranks' slices in fp64 (each slice's
// gradient converted, unless fp64 already, and squared: two [slice] fp64 temporaries of the longest slice); after it
// (stages 1-2), each group's updated slices all-gathered: this rank's [slice] packed, the [N, slice] result and the
// backend's copy of it (collective_copies). Both with every gradient and state still alive.
void DataParallelism::add_step_moments(const Workload&, const Sizes& z, StepMoments& step) const {
  if (z.N == 1 || z.stage == 0) return;
  const auto states = z.device_optimizer_states;
  const auto longest_slice = (z.largest_tensor + z.N - 1) / z.N;
  step.moments.push_back({"gradient norm (fp64, over the slices)",
                          {{"weights", z.rest_weights},
                           {"gradients", z.step_gradients()},
                           {"optimizer states", states},
                           {"fp64 copy and square of the longest slice's gradient",
                            (z.g == 8 ? 1 : 2) * 8 * longest_slice}}});
  if (z.sharded_parameters()) return;  // the slices are the parameters: no gather
  const auto largest_group = std::max({z.head_group, z.layer_grad, z.embedding_group});
  step.moments.push_back({"all-gather of the updated slices",
                          {{"weights", z.rest_weights},
                           {"gradients", z.step_gradients()},
                           {"optimizer states", states},
                           {std::string("the largest group's slice, gathered [N, slice]") +
                                (z.collective_copies ? " and the backend's copy" : ""),
                            (z.N + 1 + (z.collective_copies ? z.N : 0)) * z.slice_elements(largest_group) * z.g}}});
}

}  // namespace sbp
