// Chrome trace (Perfetto) of a memory timeline: one counter event per timeline event and one slice per run of equal
// innermost phases. Shared by the plain timeline (cpu_meter), the categorized one (memory_categories) and CUPTI's
// (cupti_export, which adds kernel and memcpy slices to the same counter track).
#pragma once

#include <ostream>
#include <string>

#include <nlohmann/json.hpp>

namespace sbp {

// events: items with .seconds and .phase; counter_args(event): the counter's values at that event (a JSON object).
// Appends to trace (a JSON array) the counter `counter` of process pid and its phase slices (thread 1).
template <typename Events, typename CounterArgs>
void append_counter_track(const Events& events, CounterArgs counter_args, const std::string& counter, int pid,
                          nlohmann::json& trace) {
  std::string phase;
  double phase_start = 0;
  auto close_phase = [&](double until) {
    if (!phase.empty())
      trace.push_back({{"name", phase}, {"ph", "X"}, {"ts", phase_start * 1e6}, {"dur", (until - phase_start) * 1e6},
                       {"pid", pid}, {"tid", 1}});
  };
  for (const auto& e : events) {
    trace.push_back({{"name", counter}, {"ph", "C"}, {"ts", e.seconds * 1e6}, {"pid", pid}, {"args", counter_args(e)}});
    if (e.phase != phase) {
      close_phase(e.seconds);
      phase = e.phase;
      phase_start = e.seconds;
    }
  }
  if (!events.empty()) close_phase(events.back().seconds);
}

template <typename Events, typename CounterArgs>
void write_counter_chrome_trace(const Events& events, CounterArgs counter_args, std::ostream& out) {
  nlohmann::json trace = nlohmann::json::array();
  append_counter_track(events, counter_args, "cpu live bytes", 1, trace);
  out << nlohmann::json{{"traceEvents", trace}, {"displayTimeUnit", "ms"}}.dump() << '\n';
}

}  // namespace sbp
