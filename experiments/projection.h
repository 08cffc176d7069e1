// What the projections beside ALST share (project --offload, project --sp): the workload of full-parameter SFT with
// AdamW in pure bf16 (the paper's full training), one sequence per rank, the kinds moved to the offload tier, and the
// largest T whose modelled device peak fits a budget.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/methods/method.h"
#include "core/methods/workload.h"
#include "core/objectives/objective.h"
#include "experiments/options.h"

namespace sbp {

// What moves to the tier in a projected row.
struct OffloadSet {
  bool checkpoints = false, gradients = false, optimizer = false, parameters = false;
  std::string name() const;  // "checkpoints,grads", or "" for none
};
// Every combination of the kinds asked for, from none to all of them.
std::vector<OffloadSet> offload_sets(const OffloadOptions& asked);

// Llama/Qwen-8B-style full SFT with AdamW, bf16 everything, batch 1, no CPU calibration (a GPU's workspaces are the
// floor term of the budget): on `world` ranks at ZeRO `zero` (NCCL: no collective copies), each sequence split over
// `sequence_parallel` of them, exchanging K/V by `scheme`.
Workload alst_workload(const ModelConfig& config, const Objective& objective, const OffloadSet& offload, int world = 1,
                       int zero = 0, int sequence_parallel = 1,
                       SequenceScheme scheme = SequenceScheme::allgather);

// Where the bisection below stops: a T that fits here is reported as this, not as a maximum.
constexpr std::int64_t kProjectionCeiling = std::int64_t(1) << 26;
// The largest T whose modelled device peak fits `budget` (0 if none), by bisection up to kProjectionCeiling; T a multiple of
// `multiple` (a sequence split over ranks: at least one position each, so the bisection starts there).
std::int64_t max_projected_seq(const BackpropMethod& method, Workload w, std::int64_t budget, std::int64_t multiple = 1);
// The same bisection for any bound that grows with T: the largest T whose training step's estimate `fits`.
std::int64_t max_projected_seq_where(const BackpropMethod& method, Workload w, std::int64_t multiple,
                                     const std::function<bool(const MemoryEstimate&)>& fits);
// The same for a bound that needs the workload itself (the disk tier places the checkpoints per T): the largest T
// for which `fits` holds of the workload at that T (seq_len set).
std::int64_t max_projected_seq_of(Workload w, std::int64_t multiple, const std::function<bool(const Workload&)>& fits);

}  // namespace sbp
