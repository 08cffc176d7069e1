// The CSV and Chrome-trace writers of cupti_recorder.h; they need no CUDA, so both builds compile this file.
#include "profiler/cupti_recorder.h"

#include <algorithm>
#include <cstdio>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "profiler/chrome_trace.h"

namespace sbp {
namespace {

std::string csv_field(const std::string& text) {
  if (text.find_first_of(",\"\r\n") == std::string::npos) return text;
  std::string quoted = "\"";
  for (const char c : text) {
    if (c == '"') quoted += '"';
    quoted += c;
  }
  return quoted + '"';
}

std::string hex_address(std::int64_t address) {
  char text[24];
  std::snprintf(text, sizeof text, "0x%llx", static_cast<unsigned long long>(address));
  return text;
}

// Chrome-trace time is in us. A double cannot hold CUPTI's ns since the epoch (~1.7e18) to the nanosecond, but it
// holds the ns since the earliest record exactly for 104 days, which is why the trace counts from there.
double microseconds_since(std::uint64_t ns, std::uint64_t origin_ns) {
  return static_cast<double>(ns - origin_ns) * 1e-3;
}

constexpr int kKernelThread = 2, kMemcpyThread = 3;  // thread 1: append_counter_track's phase slices

}  // namespace

const char* cupti_kind_name(CuptiKind kind) {
  switch (kind) {
    case CuptiKind::memory: return "memory";
    case CuptiKind::memory_pool: return "memory_pool";
    case CuptiKind::memcpy: return "memcpy";
    case CuptiKind::kernel: return "kernel";
  }
  return "unknown";
}

std::string cupti_losses(const CuptiRecording& recording) {
  return "dropped_records=" + std::to_string(recording.dropped_records) +
         " unconverted_records=" + std::to_string(recording.unconverted_records) +
         " unreadable_buffers=" + std::to_string(recording.unreadable_buffers);
}

void write_cupti_csv(const CuptiRecording& recording, std::ostream& out) {
  out << "kind,name,start_ns,end_ns,bytes,address,device\n";
  for (const CuptiRecord& r : recording.records)
    out << cupti_kind_name(r.kind) << ',' << csv_field(r.name) << ',' << r.start_ns << ',' << r.end_ns << ',' << r.bytes << ','
        << r.address << ',' << r.device << '\n';
  out << "# " << cupti_losses(recording) << '\n';
}

void write_cupti_chrome_trace(const CuptiRecording& recording, std::ostream& out) {
  const std::vector<CuptiRecord>& records = recording.records;
  const std::uint64_t origin_ns =
      records.empty() ? 0
                      : std::min_element(records.begin(), records.end(), [](const auto& a, const auto& b) {
                          return a.start_ns < b.start_ns;
                        })->start_ns;

  nlohmann::json trace = nlohmann::json::array();
  std::set<int> devices;
  std::set<std::pair<int, std::string>> memory_tracks;  // (device, memory kind)
  for (const CuptiRecord& r : records) {
    devices.insert(r.device);
    if (r.kind == CuptiKind::memory) memory_tracks.insert({r.device, r.name});
  }
  for (const int device : devices) {
    const auto name = [&](const char* what, const std::string& value) {
      return nlohmann::json{{"name", what}, {"ph", "M"}, {"pid", device}, {"args", {{"name", value}}}};
    };
    trace.push_back(name("process_name", "GPU " + std::to_string(device)));
    trace.push_back(name("thread_name", "kernels"));
    trace.back()["tid"] = kKernelThread;
    trace.push_back(name("thread_name", "memcpy"));
    trace.back()["tid"] = kMemcpyThread;
  }
  for (const auto& [device, memory_kind] : memory_tracks)
    append_counter_track(cupti_memory_timeline(records, device, memory_kind).events,
                         [](const MemoryEvent& e) { return nlohmann::json{{"bytes", e.current_bytes}}; },
                         memory_kind + " memory", device, trace);

  for (const CuptiRecord& r : records) {
    const double ts = microseconds_since(r.start_ns, origin_ns);
    if (r.kind == CuptiKind::kernel || r.kind == CuptiKind::memcpy) {
      const std::uint64_t duration_ns = r.end_ns > r.start_ns ? r.end_ns - r.start_ns : 0;
      nlohmann::json slice = {{"name", r.name}, {"cat", cupti_kind_name(r.kind)}, {"ph", "X"}, {"ts", ts},
                              {"dur", static_cast<double>(duration_ns) * 1e-3}, {"pid", r.device},
                              {"tid", r.kind == CuptiKind::kernel ? kKernelThread : kMemcpyThread}};
      if (r.kind == CuptiKind::memcpy) slice["args"] = {{"bytes", r.bytes}};
      trace.push_back(std::move(slice));
    } else if (r.kind == CuptiKind::memory_pool) {
      trace.push_back({{"name", "memory pool " + hex_address(r.address)}, {"ph", "C"}, {"ts", ts}, {"pid", r.device},
                       {"args", {{"bytes", r.bytes}}}});
    }
  }
  const nlohmann::json other = {{"origin_ns", origin_ns},
                                {"dropped_records", recording.dropped_records},
                                {"unconverted_records", recording.unconverted_records},
                                {"unreadable_buffers", recording.unreadable_buffers}};
  out << nlohmann::json{{"traceEvents", trace}, {"displayTimeUnit", "ms"}, {"otherData", other}}.dump() << '\n';
}

}  // namespace sbp
