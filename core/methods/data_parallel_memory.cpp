// The moments data parallelism adds to every method's memory model (ARCHITECTURE.md §12). They live with the methods'
// models, not with DataParallel (core/training), because each method's own moments are written in them: which
// gradients are reduced while layer l runs, which layer is gathered (memory_terms.h's Sizes); the training step's
// composition (core/training/training_memory.cpp) adds the optimizer's around them.
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
  if (!w.data_parallel()) return {};
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
                                                 (w.collective_copies() ? ", the backend's copy)" : ")")
                                           : std::string("all-reduce buffer (the group's gradients flattened)"),
                     z.reduction_buffers(group_bytes, w.collective_copies())},
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
                    {"gather buffers", z.gather_buffers(z.embedding_group + z.head_group, w.collective_copies())},
                    {"objective buffers", objective_bytes(w)}}});
  if (!streamed) return out;
  for (const auto& state : layer_states(z))
    out.push_back({"layer " + std::to_string(state.layer) + " parameter gather (backward)",
                   {{"weights", z.weights},
                    {"checkpoints", state.checkpoints},
                    {"dL/dH", btd},
                    {"gradients (of the head and the layers after)", state.gradients - z.layer_grad},
                    {"gather buffers", z.gather_buffers(z.layer_grad, w.collective_copies())},
                    {"objective buffers", objective_bytes(w)}}});
  return out;
}

}  // namespace

// Every moment data parallelism adds to a method's (none for one process).
std::vector<MemoryEstimate> data_parallel_moments(const Workload& w, bool streamed) {
  auto out = gradient_event_moments(w, streamed);
  for (auto& m : parameter_gather_moments(w, streamed)) out.push_back(std::move(m));
  return out;
}

}  // namespace sbp::memory
