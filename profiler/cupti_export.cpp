// The CSV and Chrome-trace writers of cupti_recorder.h; they need no CUDA, so both builds compile this file.
#include "profiler/cupti_recorder.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <numeric>
#include <set>
#include <utility>

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

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned>(c));
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + '"';
}

// Exact decimal microseconds: Chrome-trace time is in us, and a double cannot hold CUPTI's ns since the epoch
// (~1.7e18) to the nanosecond, which is why the trace counts from the earliest record.
std::string microseconds(std::uint64_t ns) {
  char text[32];
  std::snprintf(text, sizeof text, "%llu.%03llu", static_cast<unsigned long long>(ns / 1000),
                static_cast<unsigned long long>(ns % 1000));
  return text;
}

std::string hex_address(std::int64_t address) {
  char text[24];
  std::snprintf(text, sizeof text, "0x%llx", static_cast<unsigned long long>(address));
  return text;
}

}  // namespace

void write_cupti_csv(const std::vector<CuptiRecord>& records, std::ostream& out) {
  out << "kind,name,start_ns,end_ns,bytes,address,device\n";
  for (const CuptiRecord& r : records)
    out << r.kind << ',' << csv_field(r.name) << ',' << r.start_ns << ',' << r.end_ns << ',' << r.bytes << ','
        << r.address << ',' << r.device << '\n';
}

void write_cupti_chrome_trace(const std::vector<CuptiRecord>& records, std::ostream& out) {
  // Running totals need time order; the recorder sorts, hand-made input may not be.
  std::vector<std::size_t> order(records.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return records[a].start_ns < records[b].start_ns; });
  const std::uint64_t origin_ns = records.empty() ? 0 : records[order.front()].start_ns;

  out << "{\"displayTimeUnit\":\"ns\",\"otherData\":{\"origin_ns\":" << origin_ns << "},\"traceEvents\":[";
  const char* separator = "\n";
  auto event = [&]() -> std::ostream& {
    out << separator;
    separator = ",\n";
    return out;
  };

  std::set<int> devices;
  for (const CuptiRecord& r : records) devices.insert(r.device);
  for (const int device : devices)
    event() << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << device << ",\"args\":{\"name\":\"GPU " << device
            << "\"}}";

  std::map<std::pair<int, std::string>, std::int64_t> held_bytes;  // (device, memory kind) -> running total
  for (const std::size_t i : order) {
    const CuptiRecord& r = records[i];
    const std::string ts = microseconds(r.start_ns - origin_ns);
    if (r.kind == "kernel") {
      const std::uint64_t duration_ns = r.end_ns > r.start_ns ? r.end_ns - r.start_ns : 0;
      event() << "{\"name\":" << json_string(r.name) << ",\"cat\":\"kernel\",\"ph\":\"X\",\"ts\":" << ts
              << ",\"dur\":" << microseconds(duration_ns) << ",\"pid\":" << r.device << ",\"tid\":0}";
    } else if (r.kind == "memory") {
      const std::int64_t total = held_bytes[{r.device, r.name}] += r.bytes;
      event() << "{\"name\":\"memory\",\"cat\":\"memory\",\"ph\":\"C\",\"ts\":" << ts << ",\"pid\":" << r.device
              << ",\"args\":{" << json_string(r.name) << ':' << total << "}}";
    } else if (r.kind == "memory_pool") {
      event() << "{\"name\":\"memory_pool\",\"cat\":\"memory_pool\",\"ph\":\"C\",\"ts\":" << ts
              << ",\"pid\":" << r.device << ",\"args\":{" << json_string("pool " + hex_address(r.address)) << ':'
              << r.bytes << "}}";
    }
  }
  out << "\n]}\n";
}

}  // namespace sbp
