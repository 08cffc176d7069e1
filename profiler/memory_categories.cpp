#include "profiler/memory_categories.h"

#include <algorithm>
#include <ostream>
#include <stdexcept>
#include <unordered_map>

#include "profiler/chrome_trace.h"
#include "core/io/input_error.h"

namespace sbp {
namespace {

enum Category { kWeights, kGradients, kCheckpoints, kKV, kHead, kWorkingSet };

}  // namespace

std::vector<CategorizedEvent> categorize_timeline(const std::vector<MemoryEvent>& events, std::int64_t bytes_before,
                                                  const std::vector<std::size_t>& step_ends) {
  if (step_ends.empty() || !std::is_sorted(step_ends.begin(), step_ends.end()) || step_ends.back() > events.size())
    throw InputError("categorize_timeline: step_ends must be increasing event counts within the timeline");
  // Per block: its birth event, its death event (events.size() if it outlives the timeline).
  struct Life {
    std::size_t birth, death;
  };
  std::unordered_map<std::uint64_t, Life> lives;
  for (std::size_t i = 0; i < events.size(); ++i) {
    const auto& e = events[i];
    if (e.delta_bytes > 0) lives[e.block] = {i, events.size()};
    else if (e.delta_bytes < 0) {
      if (auto it = lives.find(e.block); it != lives.end()) it->second.death = i;
    }
  }
  // The step of an event, and the last forward-phase event of each step.
  auto step_of = [&](std::size_t i) {
    return std::size_t(std::upper_bound(step_ends.begin(), step_ends.end(), i) - step_ends.begin());
  };
  std::vector<std::size_t> forward_end(step_ends.size() + 1, 0);
  for (std::size_t i = 0; i < events.size(); ++i)
    if (events[i].phase == "forward") forward_end[step_of(i)] = i;
  auto category = [&](const Life& life) {
    const auto k = step_of(life.birth);
    const auto step_end = k < step_ends.size() ? step_ends[k] : events.size();
    const auto& phase = events[life.birth].phase;
    if (life.death >= step_end) return kGradients;
    if (phase == "forward") return life.death > forward_end[k] ? kCheckpoints : kWorkingSet;
    if (phase == "kv_recompute") return kKV;
    if (phase == "head" || phase == "statistics") return kHead;
    return kWorkingSet;
  };
  std::unordered_map<std::uint64_t, Category> category_of;
  for (const auto& [block, life] : lives) category_of[block] = category(life);

  std::vector<CategorizedEvent> out;
  out.reserve(events.size());
  CategorizedEvent now;
  now.live[kWeights] = bytes_before;
  for (const auto& e : events) {
    if (e.delta_bytes != 0) {
      // A block freed here but allocated before the timeline started is one of the "weights & batch" bytes.
      const auto it = category_of.find(e.block);
      now.live[it == category_of.end() ? kWeights : it->second] += e.delta_bytes;
    }
    now.seconds = e.seconds;
    now.phase = e.phase;
    now.current_bytes = 0;
    for (const auto b : now.live) now.current_bytes += b;
    out.push_back(now);
  }
  return out;
}

void write_categorized_csv(const std::vector<CategorizedEvent>& events, std::ostream& out) {
  out << "seconds,phase,current_bytes";
  for (const auto* c : kMemoryCategories) out << ",\"" << c << '"';
  out << '\n';
  for (const auto& e : events) {
    out << e.seconds << ',' << e.phase << ',' << e.current_bytes;
    for (const auto b : e.live) out << ',' << b;
    out << '\n';
  }
}

void write_categorized_chrome_trace(const std::vector<CategorizedEvent>& events, std::ostream& out) {
  write_counter_chrome_trace(events, [](const CategorizedEvent& e) {
    nlohmann::json args;
    for (std::size_t c = 0; c < kMemoryCategories.size(); ++c) args[kMemoryCategories[c]] = e.live[c];
    return args;
  }, out);
}

}  // namespace sbp
