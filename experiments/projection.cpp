#include "experiments/projection.h"

#include <utility>

#include "core/training/optimizer.h"
#include "core/training/optimizer_shard.h"
#include "core/training/training_memory.h"

namespace sbp {

std::string OffloadSet::name() const {
  std::string out;
  for (const auto& [on, kind] : {std::pair{checkpoints, OffloadKind::checkpoints}, {gradients, OffloadKind::gradients},
                                 {optimizer, OffloadKind::optimizer}, {parameters, OffloadKind::parameters}})
    if (on) out += (out.empty() ? "" : ",") + std::string(offload_kind_name(kind));
  return out;
}

std::vector<OffloadSet> offload_sets(const OffloadOptions& asked) {
  std::vector<OffloadSet> sets;
  for (int bits = 0; bits < 16; ++bits) {
    const OffloadSet set{bool(bits & 1), bool(bits & 2), bool(bits & 4), bool(bits & 8)};
    if ((set.checkpoints && !asked.checkpoints()) || (set.gradients && !asked.gradients()) ||
        (set.optimizer && !asked.optimizer()) || (set.parameters && !asked.parameters()))
      continue;
    sets.push_back(set);
  }
  return sets;
}

Workload alst_workload(const ModelConfig& config, const Objective& objective, const OffloadSet& offload, int world,
                       int zero, int sequence_parallel, SequenceScheme scheme) {
  Workload w;
  w.config = config;
  w.dtype = c10::kBFloat16;
  w.batch_size = 1;
  w.objective_bytes_per_token = Objective::kTargetBytesPerToken;
  w.statistics_pass = objective.has_row_term();
  w.threads = 1;
  w.workspaces = no_kernel_workspaces();  // the GPU's are the floor term, not a CPU calibration's
  w.add(DataParallelism{.world_size = world, .zero_stage = world > 1 ? zero : 0, .collective_copies = false});  // NCCL
  w.add(SequenceParallelism{sequence_parallel, scheme});
  add_projected_optimizer(w, OptimizerOptions{});  // AdamW's defaults; this rank's slices under ZeRO 1-3
  if (offload.checkpoints) w.add(Offload{OffloadKind::checkpoints});
  if (offload.optimizer) w.add(Offload{OffloadKind::optimizer});
  if (offload.gradients) w.add(Offload{OffloadKind::gradients});
  if (offload.parameters) w.add(Offload{OffloadKind::parameters});
  return w;
}

std::int64_t max_projected_seq(const BackpropMethod& method, Workload w, std::int64_t budget, std::int64_t multiple) {
  return max_projected_seq_where(method, std::move(w), multiple,
                                 [&](const MemoryEstimate& e) { return e.total_bytes() <= budget; });
}

std::int64_t max_projected_seq_where(const BackpropMethod& method, Workload w, std::int64_t multiple,
                                     const std::function<bool(const MemoryEstimate&)>& fits_estimate) {
  return max_projected_seq_of(std::move(w), multiple,
                              [&](const Workload& at) { return fits_estimate(training_memory(method, at)); });
}

std::int64_t max_projected_seq_of(Workload w, std::int64_t multiple, const std::function<bool(const Workload&)>& fits_at) {
  const auto fits = [&](std::int64_t k) {
    w.seq_len = k * multiple;
    return fits_at(w);
  };
  std::int64_t lo = 1, hi = kProjectionCeiling / multiple;
  if (!fits(lo)) return 0;
  if (fits(hi)) return hi * multiple;
  while (hi - lo > 1) {
    const auto mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo * multiple;
}

}  // namespace sbp
