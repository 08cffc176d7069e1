// What each offload kind adds to the memory models, through Offload's hooks (workload.h): what leaves the device
// (its size), one process's parameter fetches, and what the offload tier holds at its own peak.
#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "core/methods/memory_terms.h"

namespace sbp {

using namespace memory;

void Offload::size(Sizes& z) const {
  switch (kind) {
    case OffloadKind::checkpoints: z.offload_checkpoints = true; break;
    case OffloadKind::optimizer: z.device_optimizer_states = 0; break;
    case OffloadKind::gradients: z.offload_gradients = true; break;
    case OffloadKind::parameters: z.parameters_in_tier = true; break;
  }
}

// One process's parameter offload fetches a layer where ZeRO-3 gathers it (on ranks the gathers are DataParallelism's).
void Offload::add_moments(const Workload& w, bool streamed, std::vector<MemoryEstimate>& moments) const {
  if (kind != OffloadKind::parameters || !Sizes(w).offloaded_parameters) return;
  for (auto& m : parameter_gather_moments(w, streamed)) moments.push_back(std::move(m));
}

// The layer checkpoints go out in the forward and come back one by one in the backward (H[l] when layer l's backward
// takes it); the gradients arrive at their events (the head's first, layer l's after its backward, the embedding's
// last), this rank's kept share of them; the trainable tensors (one process) or ZeRO-3's slices of them are there the
// whole step.
void Offload::add_tier_terms(const Sizes& z, TierTimeline& tier) const {
  const auto btd = z.B * z.T * z.d * z.s;
  const auto head = z.kept(z.head_group), layer = z.kept(z.layer_grad), embedding = z.kept(z.embedding_group);
  // With a disk tier the host keeps only H[0..k) (the rest is offload_disk_terms'); k = L: all of them.
  const auto k = checkpoint_host_layers(z);
  for (auto& instant : tier.instants) {
    const auto l = instant.layer;
    if (kind == OffloadKind::checkpoints && l == z.L && k == z.L)
      instant.terms.push_back({"layer checkpoints H[0..L-1]", z.L * btd});
    else if (kind == OffloadKind::checkpoints && l >= 0)
      instant.terms.push_back({"layer checkpoints H[0.." + std::to_string(std::min(l, k)) + ")", std::min(l, k) * btd});
    else if (kind == OffloadKind::gradients && l == z.L)
      instant.terms.push_back({"gradients of the head", head});
    else if (kind == OffloadKind::gradients && l < 0)
      instant.terms.push_back({"gradients (every group's)", head + z.L * layer + embedding});
    else if (kind == OffloadKind::gradients)
      instant.terms.push_back({"gradients of the head and layers " + std::to_string(l) + "..L-1", head + (z.L - l) * layer});
  }
  if (kind != OffloadKind::parameters) return;
  if (z.offloaded_parameters) tier.whole_step.push_back({"trainable parameters", z.all_gradients});
  if (z.sharded_parameters())
    tier.whole_step.push_back({"parameter slices (ZeRO-3)", z.slice_elements(z.all_gradients) * z.g});
}

// The optimizer's states live in the tier the whole step (their update runs there).
void Offload::add_step_moments(const Workload& w, const Sizes&, StepMoments& step) const {
  if (kind == OffloadKind::optimizer && w.optimizer_state_bytes > 0)
    step.host.push_back({"optimizer states", w.optimizer_state_bytes});
}

std::int64_t Offload::checkpoint_host_layers(const Sizes& z) const {
  if (host_bytes >= 0) return std::min(host_bytes / (z.B * z.T * z.d * z.s), z.L);
  return host_layers < 0 ? z.L : std::min(host_layers, z.L);
}

namespace memory {

TierTimeline::TierTimeline(const Sizes& z) : instants{{z.L, {}}, {-1, {}}} {
  for (const auto l : {z.L - 1, std::int64_t(0)}) instants.push_back({l, {}});
}

std::vector<MemoryTerm> TierTimeline::peak() const {
  const auto sum = [](const Instant& i) {
    std::int64_t s = 0;
    for (const auto& t : i.terms) s += t.bytes;
    return s;
  };
  auto terms = std::max_element(instants.begin(), instants.end(),
                                [&](const auto& a, const auto& b) { return sum(a) < sum(b); })->terms;
  std::erase_if(terms, [](const MemoryTerm& t) { return t.bytes == 0; });
  terms.insert(terms.end(), whole_step.begin(), whole_step.end());
  return terms;
}

std::vector<MemoryTerm> offload_host_terms(const Workload& w) {
  const Sizes z(w);
  TierTimeline tier(z);
  for_each_feature(w, [&](const auto& f) {
    if constexpr (requires { f.add_tier_terms(z, tier); }) f.add_tier_terms(z, tier);
  });
  return tier.peak();
}

std::vector<MemoryTerm> offload_disk_terms(const Workload& w) {
  const Sizes z(w);
  std::vector<MemoryTerm> out;
  for_each_feature(w, [&](const auto& f) {
    if constexpr (std::is_same_v<std::decay_t<decltype(f)>, Offload>)
      if (f.kind == OffloadKind::checkpoints && f.checkpoint_host_layers(z) < z.L) {
        // The forward writes them in layer order; from the end of the forward until the backward reads each back,
        // the disk holds all of H[k..L-1]: its peak. A layer is placed whole (no checkpoint is split across tiers).
        const auto k = f.checkpoint_host_layers(z);
        out.push_back({"layer checkpoints H[" + std::to_string(k) + "..L-1]", (z.L - k) * z.B * z.T * z.d * z.s});
      }
  });
  return out;
}

std::int64_t offload_disk_bytes(const Workload& w) {
  std::int64_t n = 0;
  for (const auto& t : offload_disk_terms(w)) n += t.bytes;
  return n;
}

}  // namespace memory
}  // namespace sbp
