// The pure half of the CUDA memory meter (cuda_meter.h): what it does with torch's CUDA caching allocator that needs
// no CUDA call, so every build compiles it and the tests drive it with hand-made trace entries on a machine without a
// GPU. The allocator's TraceEntry lives in c10/core (no CUDA header); its facts below are those of torch 2.14.1.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <c10/core/CachingDeviceAllocator.h>

#include "profiler/cuda_meter.h"

namespace sbp {

// Turns the allocator's trace entries of one device (attachAllocatorTraceTracker calls its tracker with every one,
// under that device's allocator lock, with or without recordHistory) into the meter's timeline. Not thread-safe: the
// meter guards it with its mutex.
//
// Entries used, by action_ (device_, addr_, size_ and time_.approx_t_ of each):
//   ALLOC           +size_: a tensor's block; size_ is the requested size, not the block's rounded size, so the
//                   running total is torch's requested_bytes stat, at most the allocated_bytes the meter's peaks use.
//   FREE_COMPLETED  -size of the block at addr_: the block is back in the pool and can be handed out again.
//   FREE_REQUESTED  ignored. The tensor is gone, but a block used on another stream (record_stream) stays
//                   unusable until that stream's work is done, and only then comes FREE_COMPLETED. Without
//                   record_stream the two arrive back to back, so nothing is lost; with it, FREE_COMPLETED is when
//                   the memory truly stops being needed, which is what a smaller GPU would have to hold (torch's
//                   allocated_bytes, which the meter's peaks read, already drops at FREE_REQUESTED).
//   SEGMENT_ALLOC/MAP, SEGMENT_FREE/UNMAP  cudaMalloc/cuMemMap and cudaFree/cuMemUnmap of whole segments (reserved
//                   memory, what the budget limits): counted, no timeline event, since live bytes do not change.
//   OOM             counted with its request (size_; addr_ is the device's free bytes then); no event.
//   SNAPSHOT, ANNOTATE  ignored.
// time_ is a union: the allocator fills approx_t_ (c10::getApproximateTime(), TSC ticks on x86, not nanoseconds);
// t_ is only written when torch post-processes a snapshot, never in a tracker's entry.
class AllocatorTraceAdapter {
 public:
  using TraceEntry = c10::CachingDeviceAllocator::TraceEntry;

  explicit AllocatorTraceAdapter(int device) : device_(device) {}

  // Every entry goes here, recording or not (the largest allocation is kept either way); entries of another
  // device are ignored. `phase`: the innermost open phase now, "" outside any.
  void on_trace(const TraceEntry& entry, std::string_view phase);

  // Largest ALLOC size_ since construction or reset_largest().
  std::int64_t largest_allocation_bytes() const { return largest_; }
  void reset_largest() { largest_ = 0; }

  // Starts a timeline: clears events and counts, and records a first mark. `live_bytes`: requested bytes already live
  // (the first current_bytes; a block freed later that was allocated before the start subtracts its size_ from
  // it); `origin_ticks`: c10::getApproximateTime() now, the zero of every event's seconds.
  void start(std::int64_t live_bytes, c10::approx_time_t origin_ticks, std::string_view phase);
  bool recording() const { return recording_; }
  // A phase boundary at `ticks` (an event with block 0 and delta 0, like the CPU meter's); ignored unless recording.
  void mark(c10::approx_time_t ticks, std::string_view phase);
  std::size_t size() const { return events_.size(); }
  // Of the timeline being recorded, or of the last one after stop().
  const AllocatorTraceCounts& counts() const { return counts_; }

  // Stops and returns the events in arrival order. `ticks_to_ns` maps the approximate clock to nanoseconds on any
  // fixed origin: c10::ApproximateClockToUnixTimeConverter::makeConverter() on a real run (its start pairs measured
  // before `origin_ticks`), the identity where ticks are nanoseconds (no cycle counter on the platform; the tests).
  std::vector<MemoryEvent> stop(const std::function<std::int64_t(c10::approx_time_t)>& ticks_to_ns);

 private:
  struct Block {
    std::int64_t size_bytes;
    std::uint64_t id;
  };
  void record(c10::approx_time_t ticks, std::string_view phase, std::uint64_t block, std::int64_t delta_bytes);

  int device_;
  std::int64_t largest_ = 0;
  bool recording_ = false;
  std::int64_t live_bytes_ = 0;
  c10::approx_time_t origin_ticks_{};
  std::uint64_t next_id_ = 1;
  std::unordered_map<std::size_t, Block> blocks_;  // by address: blocks allocated since start() and still live
  std::vector<MemoryEvent> events_;                // seconds filled in by stop()
  std::vector<c10::approx_time_t> ticks_;          // ticks of events_[i]
  AllocatorTraceCounts counts_;
};

// The caching allocator's per-process memory fraction that makes its limit exactly `budget_bytes` on a device of
// `total_bytes` (cudaDeviceProp::totalGlobalMem): torch 2.14 sets the limit to size_t(fraction * double(total)), so
// the fraction is chosen for that truncation to land on the budget. 1.0 (no limit) for a budget <= 0 or >= total.
double memory_fraction_for_budget(std::int64_t budget_bytes, std::size_t total_bytes);

}  // namespace sbp
