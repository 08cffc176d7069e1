// `train --metrics`: one row per optimizer step. The header and the values come from one table of (column, cell)
// pairs, so a column cannot be added to one without the other.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/training/communicator.h"
#include "core/training/trainer.h"

namespace sbp {

// What one step's row says: the Trainer's result, the measured peak and the collectives of the step.
struct StepMetrics {
  TrainStepResult step;
  std::optional<std::int64_t> peak_bytes;  // empty on CUDA (the CPU meter's)
  int world_size = 1, zero = 0, sp = 1;
  CollectiveStats all_reduce, reduce_scatter, all_gather;           // over every rank (data parallelism)
  CollectiveStats sp_all_gather, sp_reduce_scatter, sp_all_reduce;  // within the sequence-parallel group
  CollectiveStats sp_ring_shift;  // the ring's hops (--sp-scheme ring)
};

// "step,loss,...": the first line of every metrics file (a resumed run checks it).
const std::string& metrics_header();
// One row in the header's order: loss, grad norm and lr with 17 digits (they round-trip), times to the microsecond.
std::string metrics_row(const StepMetrics& m);

}  // namespace sbp
