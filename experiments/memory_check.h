// Before a step: whether the memory model's peak fits what the step may use, and the longest sequence that would.
// A step that cannot fit is refused in a second instead of failing after minutes (issue #44); maxlen's prediction is
// the same search.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/methods/workload.h"
#include "experiments/available_memory.h"

namespace sbp {

struct MemoryCheck {
  std::int64_t peak_bytes = 0;    // the model's peak of the step, its weights included
  std::string peak_moment;        // when it happens
  std::int64_t limit_bytes = -1;  // the largest peak the step may reach; -1: no limit known, nothing to check
  std::string limited_by;         // what sets it: "--budget-bytes 1000000000", "ulimit -v (limit ..., ... mapped) ..."
  std::int64_t max_seq = -1;      // a step that does not fit: the longest T whose modelled peak fits (0: none)
  std::vector<MemoryLimit> limits;  // the process's limits it was held against
  bool fits() const { return limit_bytes < 0 || peak_bytes <= limit_bytes; }
};

// peak_at(T): the model's peak of the step at sequence length T, the rest of its workload as it is; `seq_len` the
// step's, `moment` when its peak happens. A budget (budget_bytes > 0) is the device the step stands in for: a limit
// on the peak itself, as the meter enforces it. The process's `limits` (memory_limits()) bound further memory, so
// `held_bytes`, the part of the peak already allocated (the model's weights), is added to what is left under them.
// The tightest of these is the step's limit. No limit on a GPU's own memory is read: there, only a budget.
MemoryCheck check_memory(const std::function<std::int64_t(std::int64_t)>& peak_at, std::int64_t seq_len,
                         const std::string& moment, std::int64_t budget_bytes, const std::vector<MemoryLimit>& limits,
                         std::int64_t held_bytes);

// The same for a workload whose peak `model` gives (a method's memory_model, or training_memory around it), at any
// T: held against the budget and, on the CPU (`cpu`), the process's limits (memory_limits()).
MemoryCheck check_workload_memory(const std::function<MemoryEstimate(const Workload&)>& model, const Workload& workload,
                                  std::int64_t budget_bytes, bool cpu, std::int64_t held_bytes);

// Why a step does not fit: the prediction, the limit, and what would fit at `batch_size` rows.
std::string memory_shortfall(const MemoryCheck& check, std::int64_t batch_size);

// The largest T in [shortest, longest] whose modelled peak is at most `limit_bytes` (the models grow with T), 0 when
// not even the shortest fits.
std::int64_t longest_fitting_seq(const std::function<std::int64_t(std::int64_t)>& peak_at, std::int64_t shortest,
                                 std::int64_t longest, std::int64_t limit_bytes);

}  // namespace sbp
