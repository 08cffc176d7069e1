// What the live bytes of a memory timeline are (the paper's Fig. 1/8), from the allocator's events alone: a block is
// put in a category by the phase that allocated it and by how long it lived. The allocator knows nothing else about
// a block, so this is an attribution rule, stated here and in the figure:
//   weights & batch            live before the first step
//   gradients                  allocated in a step and still alive at its end (what a step leaves: the gradients)
//   checkpoints / activations  allocated in the forward phase and alive after it (layer inputs; standard BP's graph)
//   K/V                        allocated in StreamBP's K/V recompute phase
//   logits / head              allocated in the head or statistics phase
//   working set                everything else: a chunk's graph, attention scratch, re-forwarded layers
#pragma once

#include <array>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "profiler/cpu_meter.h"

namespace sbp {

inline constexpr std::array<const char*, 6> kMemoryCategories = {
    "weights & batch", "gradients", "checkpoints / activations", "K/V", "logits / head", "working set"};

struct CategorizedEvent {
  double seconds = 0;
  std::string phase;
  std::int64_t current_bytes = 0;                          // all of them (weights & batch included)
  std::array<std::int64_t, kMemoryCategories.size()> live{};  // by category; sums to current_bytes
};

// events: one timeline (CpuMemoryMeter::start_timeline .. stop_timeline); bytes_before: live bytes when it started;
// step_ends: the number of events recorded when each step ended (increasing; the last one <= events.size()).
std::vector<CategorizedEvent> categorize_timeline(const std::vector<MemoryEvent>& events, std::int64_t bytes_before,
                                                  const std::vector<std::size_t>& step_ends);

void write_categorized_csv(const std::vector<CategorizedEvent>& events, std::ostream& out);
// Chrome trace (Perfetto): one stacked counter track of the categories, one slice per phase.
void write_categorized_chrome_trace(const std::vector<CategorizedEvent>& events, std::ostream& out);

}  // namespace sbp
