#include "profiler/caching_allocator.h"

#include <algorithm>
#include <cmath>

namespace sbp {

void AllocatorTraceAdapter::on_trace(const TraceEntry& entry, std::string_view phase) {
  if (entry.device_ != device_) return;
  const auto size_bytes = static_cast<std::int64_t>(entry.size_);
  const c10::approx_time_t ticks = entry.time_.approx_t_;
  using Action = TraceEntry::Action;
  switch (entry.action_) {
    case Action::ALLOC:
      largest_ = std::max(largest_, size_bytes);
      if (!recording_) return;
      blocks_[entry.addr_] = {size_bytes, next_id_};
      live_bytes_ += size_bytes;
      record(ticks, phase, next_id_++, size_bytes);
      return;
    case Action::FREE_COMPLETED: {
      if (!recording_) return;
      // A block allocated before start() is not in blocks_; its size_ is the same requested size ALLOC had.
      Block block{size_bytes, 0};
      if (auto it = blocks_.find(entry.addr_); it != blocks_.end()) {
        block = it->second;
        blocks_.erase(it);
      } else {
        block.id = next_id_++;
      }
      live_bytes_ -= block.size_bytes;
      record(ticks, phase, block.id, -block.size_bytes);
      return;
    }
    case Action::SEGMENT_ALLOC:
    case Action::SEGMENT_MAP:
      if (!recording_) return;
      ++counts_.segment_allocs;
      counts_.reserved_delta_bytes += size_bytes;
      return;
    case Action::SEGMENT_FREE:
    case Action::SEGMENT_UNMAP:
      if (!recording_) return;
      ++counts_.segment_frees;
      counts_.reserved_delta_bytes -= size_bytes;
      return;
    case Action::OOM:
      if (!recording_) return;
      ++counts_.ooms;
      counts_.oom_requested_bytes = size_bytes;
      return;
    default:  // FREE_REQUESTED (see the header), SNAPSHOT, ANNOTATE
      return;
  }
}

void AllocatorTraceAdapter::start(std::int64_t live_bytes, c10::approx_time_t origin_ticks, std::string_view phase) {
  recording_ = true;
  live_bytes_ = live_bytes;
  origin_ticks_ = origin_ticks;
  next_id_ = 1;
  blocks_.clear();
  events_.clear();
  ticks_.clear();
  counts_ = {};
  record(origin_ticks, phase, 0, 0);
}

void AllocatorTraceAdapter::mark(c10::approx_time_t ticks, std::string_view phase) {
  if (recording_) record(ticks, phase, 0, 0);
}

void AllocatorTraceAdapter::record(c10::approx_time_t ticks, std::string_view phase, std::uint64_t block,
                                   std::int64_t delta_bytes) {
  events_.push_back({0.0, live_bytes_, std::string(phase), block, delta_bytes});
  ticks_.push_back(ticks);
}

std::vector<MemoryEvent> AllocatorTraceAdapter::stop(
    const std::function<std::int64_t(c10::approx_time_t)>& ticks_to_ns) {
  recording_ = false;
  blocks_.clear();
  const std::int64_t origin_ns = ticks_to_ns(origin_ticks_);
  for (std::size_t i = 0; i < events_.size(); ++i)
    events_[i].seconds = double(ticks_to_ns(ticks_[i]) - origin_ns) * 1e-9;
  ticks_.clear();
  std::vector<MemoryEvent> out = std::move(events_);
  events_.clear();
  return out;
}

double memory_fraction_for_budget(std::int64_t budget_bytes, std::size_t total_bytes) {
  if (budget_bytes <= 0 || std::uint64_t(budget_bytes) >= total_bytes) return 1.0;
  const double total = double(total_bytes);
  const auto limit = [&](double fraction) { return std::uint64_t(fraction * total); };
  const auto budget = std::uint64_t(budget_bytes);
  // Half a byte above the budget: the product's rounding error (budget * 2^-52, under 2^-4 bytes for budgets below
  // 2^48 = 256 TiB) cannot move it across an integer, so the truncation gives the budget.
  double fraction = (double(budget) + 0.5) / total;
  // Where that no longer holds, step down until the limit is not above the budget.
  while (limit(fraction) > budget) fraction = std::nextafter(fraction, 0.0);
  return fraction;
}

}  // namespace sbp
