#include "experiments/memory_check.h"

#include <fmt/format.h>

#include "experiments/measure.h"

namespace sbp {

std::int64_t longest_fitting_seq(const std::function<std::int64_t(std::int64_t)>& peak_at, std::int64_t shortest,
                                 std::int64_t longest, std::int64_t limit_bytes) {
  if (longest < shortest || peak_at(shortest) > limit_bytes) return 0;
  if (peak_at(longest) <= limit_bytes) return longest;
  std::int64_t lo = shortest, hi = longest;  // peak_at(lo) fits, peak_at(hi) does not
  while (hi - lo > 1) {
    const auto mid = lo + (hi - lo) / 2;
    (peak_at(mid) <= limit_bytes ? lo : hi) = mid;
  }
  return lo;
}

MemoryCheck check_memory(const std::function<std::int64_t(std::int64_t)>& peak_at, std::int64_t seq_len,
                         const std::string& moment, std::int64_t budget_bytes, const std::vector<MemoryLimit>& limits,
                         std::int64_t held_bytes) {
  MemoryCheck check;
  check.peak_bytes = peak_at(seq_len);
  check.peak_moment = moment;
  check.limits = limits;
  if (budget_bytes > 0) {
    check.limit_bytes = budget_bytes;
    check.limited_by = fmt::format("--budget-bytes {}", budget_bytes);
  }
  for (const auto& l : limits)
    if (check.limit_bytes < 0 || l.left_bytes + held_bytes < check.limit_bytes) {
      check.limit_bytes = l.left_bytes + held_bytes;
      check.limited_by = fmt::format("{}: {} left ({}), beside the {} of weights already allocated", l.name,
                                     format_bytes(l.left_bytes), l.detail, format_bytes(held_bytes));
    }
  // The shortest sequence any step takes (--seq's minimum).
  if (!check.fits()) check.max_seq = longest_fitting_seq(peak_at, 2, seq_len - 1, check.limit_bytes);
  return check;
}

std::string memory_shortfall(const MemoryCheck& check, std::int64_t batch_size) {
  return fmt::format(
      "the memory model's peak of this step is {} (at {}), above the {} it may use ({}); {}",
      format_bytes(check.peak_bytes), check.peak_moment, format_bytes(check.limit_bytes), check.limited_by,
      check.max_seq > 0 ? fmt::format("at B = {} the longest sequence that fits is T = {}", batch_size, check.max_seq)
                        : fmt::format("no sequence fits at B = {}", batch_size));
}

MemoryCheck check_workload_memory(const std::function<MemoryEstimate(const Workload&)>& model, const Workload& workload,
                                  std::int64_t budget_bytes, bool cpu, std::int64_t held_bytes) {
  const auto peak_at = [&](std::int64_t T) {
    auto w = workload;
    w.seq_len = T;
    return model(w).total_bytes();
  };
  return check_memory(peak_at, workload.seq_len, model(workload).moment, budget_bytes,
                      cpu ? memory_limits() : std::vector<MemoryLimit>{}, held_bytes);
}

}  // namespace sbp
