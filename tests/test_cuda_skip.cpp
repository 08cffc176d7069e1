// The CUDA half of the profiler skips cleanly without a GPU (these machines have none) and holds its invariants with
// one; the CUPTI writers are checked on hand-made records, so they are tested everywhere.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <sstream>

#include "profiler/cuda_memory.h"
#include "profiler/cupti_recorder.h"

namespace {

// A kernel whose demangled name has a comma (CSV must quote it) and one device allocation before it.
std::vector<sbp::CuptiRecord> two_records() {
  sbp::CuptiRecord kernel{"kernel", "void add<float, 4>(float*)", 5'000'500, 5'002'750, 0, 0, 0};
  sbp::CuptiRecord memory{"memory", "device", 5'000'000, 5'000'000, 2'097'152, 0x7f0000000000, 0};
  return {kernel, memory};  // out of time order on purpose: the trace writer must not rely on it
}

const nlohmann::json* find_event(const nlohmann::json& trace, const std::string& phase) {
  for (const auto& event : trace.at("traceEvents"))
    if (event.at("ph") == phase) return &event;
  return nullptr;
}

}  // namespace

TEST_CASE("cuda_device_available gives a reason exactly when there is no GPU", "[cuda]") {
  std::string reason;
  const bool available = sbp::cuda_device_available(&reason);
  INFO("reason: " << reason);
  if (!available) CHECK_FALSE(reason.empty());
  CHECK(sbp::cuda_device_available() == available);  // the reason pointer is optional
}

TEST_CASE("cuda_memory_stats are unavailable with a reason without a GPU, consistent with one", "[cuda]") {
  const bool gpu = sbp::cuda_device_available();
  sbp::cuda_reset_peak_stats();  // a no-op without a GPU, must not throw
  const sbp::CudaMemoryStats stats = sbp::cuda_memory_stats();
  CHECK(stats.available == gpu);
  if (!stats.available) {
    CHECK_FALSE(stats.reason.empty());
    CHECK(stats.allocated_peak_bytes == 0);
    CHECK(stats.reserved_peak_bytes == 0);
  } else {
    // Right after a reset nothing has been allocated, so the peaks are the current values.
    CHECK(stats.allocated_peak_bytes == stats.allocated_current_bytes);
    CHECK(stats.reserved_peak_bytes == stats.reserved_current_bytes);
    CHECK(stats.reserved_current_bytes >= stats.allocated_current_bytes);
  }
}

TEST_CASE("cuda_memory_stats of a device that does not exist are unavailable", "[cuda]") {
  const sbp::CudaMemoryStats stats = sbp::cuda_memory_stats(1000);
  CHECK_FALSE(stats.available);
  CHECK_FALSE(stats.reason.empty());
}

TEST_CASE("CuptiRecorder refuses to start without a GPU and then records nothing", "[cuda][cupti]") {
  sbp::CuptiRecorder recorder;
  std::string reason;
  const bool started = recorder.start(&reason);
  INFO("reason: " << reason);
  if (!sbp::cuda_device_available()) CHECK_FALSE(started);
  if (!started) CHECK_FALSE(reason.empty());
  if (started) {
    sbp::CuptiRecorder second;
    CHECK_FALSE(second.start());  // CUPTI's callbacks are process-wide
  }
  const std::vector<sbp::CuptiRecord> records = recorder.stop();
  if (!started) CHECK(records.empty());
  CHECK(std::is_sorted(records.begin(), records.end(),
                       [](const auto& a, const auto& b) { return a.start_ns < b.start_ns; }));
  CHECK(recorder.stop().empty());  // stopped already
}

TEST_CASE("CUPTI CSV has the documented header and quotes a name with a comma", "[cupti]") {
  std::ostringstream csv;
  sbp::write_cupti_csv(two_records(), csv);
  CHECK(csv.str() ==
        "kind,name,start_ns,end_ns,bytes,address,device\n"
        "kernel,\"void add<float, 4>(float*)\",5000500,5002750,0,0,0\n"
        "memory,device,5000000,5000000,2097152,139637976727552,0\n");
}

TEST_CASE("CUPTI Chrome trace is valid JSON with a kernel slice and a memory counter", "[cupti]") {
  std::ostringstream out;
  sbp::write_cupti_chrome_trace(two_records(), out);
  INFO(out.str());
  const nlohmann::json trace = nlohmann::json::parse(out.str());
  CHECK(trace.at("otherData").at("origin_ns") == 5'000'000);  // the earliest record, the memory one

  const nlohmann::json* kernel = find_event(trace, "X");
  REQUIRE(kernel != nullptr);
  CHECK(kernel->at("name") == "void add<float, 4>(float*)");
  CHECK(kernel->at("ts").get<double>() == Approx(0.5));   // us after the origin
  CHECK(kernel->at("dur").get<double>() == Approx(2.25));  // 2250 ns
  CHECK(kernel->at("pid") == 0);

  const nlohmann::json* counter = find_event(trace, "C");
  REQUIRE(counter != nullptr);
  CHECK(counter->at("ts").get<double>() == Approx(0.0));
  CHECK(counter->at("args").at("device") == 2'097'152);

  const nlohmann::json* process = find_event(trace, "M");
  REQUIRE(process != nullptr);
  CHECK(process->at("args").at("name") == "GPU 0");
}

TEST_CASE("CUPTI Chrome trace memory counter is the running total of allocations minus releases", "[cupti]") {
  const std::vector<sbp::CuptiRecord> records = {
      {"memory", "device", 100, 100, 1024, 0x1000, 0},
      {"memory", "device", 200, 200, 2048, 0x2000, 0},
      {"memory", "device", 300, 300, -1024, 0x1000, 0},
  };
  std::ostringstream out;
  sbp::write_cupti_chrome_trace(records, out);
  const nlohmann::json trace = nlohmann::json::parse(out.str());
  std::vector<std::int64_t> totals;
  for (const auto& event : trace.at("traceEvents"))
    if (event.at("ph") == "C") totals.push_back(event.at("args").at("device").get<std::int64_t>());
  CHECK(totals == std::vector<std::int64_t>{1024, 3072, 2048});
}

TEST_CASE("CUPTI writers accept no records", "[cupti]") {
  std::ostringstream csv, trace;
  sbp::write_cupti_csv({}, csv);
  sbp::write_cupti_chrome_trace({}, trace);
  CHECK(csv.str() == "kind,name,start_ns,end_ns,bytes,address,device\n");
  CHECK(nlohmann::json::parse(trace.str()).at("traceEvents").empty());
}
