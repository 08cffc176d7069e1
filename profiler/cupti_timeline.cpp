// cupti_memory_timeline of cupti_recorder.h: CUPTI's memory records as the CPU meter's timeline. No CUDA needed.
#include "profiler/cupti_recorder.h"

#include <algorithm>
#include <unordered_set>

namespace sbp {

CuptiTimeline cupti_memory_timeline(const std::vector<CuptiRecord>& records, int device,
                                    const std::string& memory_kind) {
  CuptiTimeline timeline;
  if (records.empty()) return timeline;
  timeline.origin_ns = std::min_element(records.begin(), records.end(), [](const auto& a, const auto& b) {
                         return a.start_ns < b.start_ns;
                       })->start_ns;

  std::vector<const CuptiRecord*> memory;
  for (const CuptiRecord& r : records)
    if (r.kind == CuptiKind::memory && r.device == device && r.name == memory_kind) memory.push_back(&r);
  // The recorder sorts; hand-made input may not be. Stable: an allocation and a release in the same nanosecond
  // keep CUPTI's order.
  std::stable_sort(memory.begin(), memory.end(),
                   [](const CuptiRecord* a, const CuptiRecord* b) { return a->start_ns < b->start_ns; });

  // A release of a block this recording never saw allocated was held since before the origin.
  std::unordered_set<std::int64_t> live;
  for (const CuptiRecord* r : memory) {
    if (r->bytes >= 0) {
      live.insert(r->address);
    } else if (live.erase(r->address) == 0) {
      timeline.bytes_before -= r->bytes;
      ++timeline.blocks_before;
    }
  }

  timeline.events.reserve(memory.size() + 1);
  std::int64_t current_bytes = timeline.bytes_before;
  timeline.events.push_back({0.0, current_bytes, "", 0, 0});
  for (const CuptiRecord* r : memory) {
    current_bytes += r->bytes;
    timeline.events.push_back({static_cast<double>(r->start_ns - timeline.origin_ns) * 1e-9, current_bytes, "",
                               static_cast<std::uint64_t>(r->address), r->bytes});
  }
  return timeline;
}

CopyOverlap copy_overlap(const std::vector<CuptiRecord>& records, const std::string& direction) {
  CopyOverlap out;
  for (const auto& copy : records) {
    if (copy.kind != CuptiKind::memcpy || copy.name != direction) continue;
    ++out.copies;
    const bool overlaps = std::any_of(records.begin(), records.end(), [&](const CuptiRecord& k) {
      return k.kind == CuptiKind::kernel && k.device == copy.device && k.start_ns < copy.end_ns && copy.start_ns < k.end_ns;
    });
    if (overlaps) ++out.overlapping;
  }
  return out;
}

}  // namespace sbp
