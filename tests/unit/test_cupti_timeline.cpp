// CUPTI records -> the CPU meter's memory timeline, and the CUPTI writers, on hand-made records: no CUDA needed, so
// these run in every build (parsing real activity buffers is test_cupti.cpp, CUDA builds only).
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <sstream>
#include <string>
#include <vector>

#include "profiler/cupti_recorder.h"
#include "tests/support/test_support.h"

namespace {

using sbp::test::kMiB;

sbp::CuptiRecord alloc(std::int64_t address, std::int64_t bytes, std::uint64_t ns, int device = 0,
                       const std::string& memory_kind = "device") {
  return {sbp::CuptiKind::memory, memory_kind, ns, ns, bytes, address, device};
}

sbp::CuptiRecord release(std::int64_t address, std::int64_t bytes, std::uint64_t ns, int device = 0,
                         const std::string& memory_kind = "device") {
  return {sbp::CuptiKind::memory, memory_kind, ns, ns, -bytes, address, device};
}

// A kernel first (it sets the origin), two device blocks, a copy, a release; a pinned block; device 1's block.
sbp::CuptiRecording two_device_recording() {
  sbp::CuptiRecording recording;
  recording.records = {
      {sbp::CuptiKind::kernel, "void add<float, 4>(float*)", 1'000, 3'000, 0, 0, 0},
      alloc(0x1000, kMiB, 2'000),
      {sbp::CuptiKind::memcpy, "HtoD", 2'500, 3'500, 4096, 0, 0},
      alloc(0x2000, 2 * kMiB, 3'000),
      alloc(0x9000, 65536, 3'200, 0, "pinned"),
      alloc(0x1000, 4 * kMiB, 4'000, 1),  // same address on another device: another block
      release(0x1000, kMiB, 5'000),
      {sbp::CuptiKind::memory_pool, "created", 6'000, 6'000, 8 * kMiB, 0x5000, 0},
  };
  recording.dropped_records = 7;
  recording.unconverted_records = 3;
  recording.unreadable_buffers = 1;
  return recording;
}

struct Point {
  double seconds;
  std::int64_t current_bytes;
  std::uint64_t block;
  std::int64_t delta_bytes;
};

void check_events(const std::vector<sbp::MemoryEvent>& events, const std::vector<Point>& expected) {
  REQUIRE(events.size() == expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    INFO("event " << i);
    CHECK(events[i].seconds == Approx(expected[i].seconds).margin(1e-15));
    CHECK(events[i].current_bytes == expected[i].current_bytes);
    CHECK(events[i].block == expected[i].block);
    CHECK(events[i].delta_bytes == expected[i].delta_bytes);
    CHECK(events[i].phase.empty());  // CUPTI sees no phases
  }
}

// A counter track's (ts in us, bytes) points; ts goes through seconds, so it is compared to 1e-9 us.
void check_counter(const std::vector<std::pair<double, std::int64_t>>& points,
                   const std::vector<std::pair<double, std::int64_t>>& expected) {
  REQUIRE(points.size() == expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    INFO("point " << i);
    CHECK(points[i].first == Approx(expected[i].first).margin(1e-9));
    CHECK(points[i].second == expected[i].second);
  }
}

}  // namespace

TEST_CASE("cupti_memory_timeline is the running total of one device's device memory, from the first record",
          "[cupti]") {
  const sbp::CuptiTimeline timeline = sbp::cupti_memory_timeline(two_device_recording().records, 0);
  CHECK(timeline.origin_ns == 1'000);  // the kernel: every track and slice shares this clock
  CHECK(timeline.bytes_before == 0);
  CHECK(timeline.blocks_before == 0);
  check_events(timeline.events, {{0, 0, 0, 0},  // the origin mark
                                 {1e-6, kMiB, 0x1000, kMiB},
                                 {2e-6, 3 * kMiB, 0x2000, 2 * kMiB},
                                 {4e-6, 2 * kMiB, 0x1000, -kMiB}});
}

TEST_CASE("cupti_memory_timeline keeps devices and memory kinds apart", "[cupti]") {
  const auto records = two_device_recording().records;
  check_events(sbp::cupti_memory_timeline(records, 1).events, {{0, 0, 0, 0}, {3e-6, 4 * kMiB, 0x1000, 4 * kMiB}});
  check_events(sbp::cupti_memory_timeline(records, 0, "pinned").events, {{0, 0, 0, 0}, {2.2e-6, 65536, 0x9000, 65536}});
  check_events(sbp::cupti_memory_timeline(records, 2).events, {{0, 0, 0, 0}});  // no memory there, only the mark
}

TEST_CASE("cupti_memory_timeline holds a block released but allocated before the recording from the origin",
          "[cupti]") {
  // 0xA000 (3 MiB) was allocated before the recording: its release must not take the curve below 0.
  const std::vector<sbp::CuptiRecord> records = {alloc(0x1000, kMiB, 100), release(0xA000, 3 * kMiB, 200),
                                                 release(0x1000, kMiB, 300), release(0xB000, kMiB, 400)};
  const sbp::CuptiTimeline timeline = sbp::cupti_memory_timeline(records, 0);
  CHECK(timeline.bytes_before == 4 * kMiB);
  CHECK(timeline.blocks_before == 2);
  check_events(timeline.events, {{0, 4 * kMiB, 0, 0},
                                 {0, 5 * kMiB, 0x1000, kMiB},
                                 {1e-7, 2 * kMiB, 0xA000, -3 * kMiB},
                                 {2e-7, kMiB, 0x1000, -kMiB},
                                 {3e-7, 0, 0xB000, -kMiB}});
  for (const auto& e : timeline.events) CHECK(e.current_bytes >= 0);
}

TEST_CASE("cupti_memory_timeline sorts hand-made records by time, keeping the order of equal times", "[cupti]") {
  // Address reuse in one nanosecond: a release then an allocation of the same address, listed after a later event.
  const std::vector<sbp::CuptiRecord> records = {alloc(0x2000, 2 * kMiB, 900), alloc(0x1000, kMiB, 100),
                                                 release(0x1000, kMiB, 500), alloc(0x1000, 4 * kMiB, 500)};
  const sbp::CuptiTimeline timeline = sbp::cupti_memory_timeline(records, 0);
  CHECK(timeline.origin_ns == 100);
  CHECK(timeline.bytes_before == 0);
  check_events(timeline.events, {{0, 0, 0, 0},
                                 {0, kMiB, 0x1000, kMiB},
                                 {4e-7, 0, 0x1000, -kMiB},
                                 {4e-7, 4 * kMiB, 0x1000, 4 * kMiB},
                                 {8e-7, 6 * kMiB, 0x2000, 2 * kMiB}});
}

TEST_CASE("cupti_memory_timeline of no records is empty", "[cupti]") {
  const sbp::CuptiTimeline timeline = sbp::cupti_memory_timeline({}, 0);
  CHECK(timeline.events.empty());
  CHECK(timeline.origin_ns == 0);
}

TEST_CASE("write_cupti_csv has the documented header, quotes a name with a comma and ends with the losses",
          "[cupti]") {
  sbp::CuptiRecording recording;
  recording.records = {{sbp::CuptiKind::kernel, "void add<float, 4>(float*)", 5'000'500, 5'002'750, 0, 0, 0},
                       alloc(0x7f0000000000, 2 * kMiB, 5'000'000)};
  recording.dropped_records = 2;
  recording.unconverted_records = 5;
  std::ostringstream csv;
  sbp::write_cupti_csv(recording, csv);
  CHECK(csv.str() ==
        "kind,name,start_ns,end_ns,bytes,address,device\n"
        "kernel,\"void add<float, 4>(float*)\",5000500,5002750,0,0,0\n"
        "memory,device,5000000,5000000,2097152,139637976727552,0\n"
        "# dropped_records=2 unconverted_records=5 unreadable_buffers=0\n");
}

TEST_CASE("write_cupti_chrome_trace: memory timeline counters, kernel and memcpy slices, losses", "[cupti]") {
  const sbp::CuptiRecording recording = two_device_recording();
  std::ostringstream out;
  sbp::write_cupti_chrome_trace(recording, out);
  INFO(out.str());
  const nlohmann::json trace = nlohmann::json::parse(out.str());
  const nlohmann::json& other = trace.at("otherData");
  CHECK(other.at("origin_ns") == 1'000);
  CHECK(other.at("dropped_records") == 7);
  CHECK(other.at("unconverted_records") == 3);
  CHECK(other.at("unreadable_buffers") == 1);

  // The counter of GPU 0's device memory is its cupti_memory_timeline, event for event.
  std::vector<std::pair<double, std::int64_t>> device0, pinned0, device1, pool;
  std::vector<std::string> processes;
  const nlohmann::json* kernel = nullptr;
  const nlohmann::json* copy = nullptr;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") == "C") {
      const auto point = std::make_pair(e.at("ts").get<double>(), e.at("args").at("bytes").get<std::int64_t>());
      if (e.at("name") == "device memory") (e.at("pid") == 0 ? device0 : device1).push_back(point);
      if (e.at("name") == "pinned memory") pinned0.push_back(point);
      if (e.at("name") == "memory pool 0x5000") pool.push_back(point);
    } else if (e.at("ph") == "X") {
      (e.at("cat") == "kernel" ? kernel : copy) = &e;
    } else if (e.at("name") == "process_name") {
      processes.push_back(e.at("args").at("name"));
    }
  }
  check_counter(device0, {{0, 0}, {1, kMiB}, {2, 3 * kMiB}, {4, 2 * kMiB}});  // us since the origin
  check_counter(device1, {{0, 0}, {3, 4 * kMiB}});
  check_counter(pinned0, {{0, 0}, {2.2, 65536}});
  check_counter(pool, {{5, 8 * kMiB}});
  CHECK(processes == std::vector<std::string>{"GPU 0", "GPU 1"});

  REQUIRE(kernel != nullptr);
  CHECK(kernel->at("name") == "void add<float, 4>(float*)");
  CHECK(kernel->at("ts").get<double>() == Approx(0.0));
  CHECK(kernel->at("dur").get<double>() == Approx(2.0));
  CHECK(kernel->at("pid") == 0);
  REQUIRE(copy != nullptr);
  CHECK(copy->at("name") == "HtoD");
  CHECK(copy->at("ts").get<double>() == Approx(1.5));
  CHECK(copy->at("dur").get<double>() == Approx(1.0));
  CHECK(copy->at("args").at("bytes") == 4096);
  CHECK(copy->at("tid") != kernel->at("tid"));
}

TEST_CASE("cupti writers accept no records", "[cupti]") {
  std::ostringstream csv, trace;
  sbp::write_cupti_csv({}, csv);
  sbp::write_cupti_chrome_trace({}, trace);
  CHECK(csv.str() ==
        "kind,name,start_ns,end_ns,bytes,address,device\n"
        "# dropped_records=0 unconverted_records=0 unreadable_buffers=0\n");
  const nlohmann::json parsed = nlohmann::json::parse(trace.str());
  CHECK(parsed.at("traceEvents").empty());
  CHECK(parsed.at("otherData").at("dropped_records") == 0);
}

// The offload tier's prefetch check (tests/gpu/run.sh step 9b reads the line it prints) on hand-made records: a fetch
// during a kernel overlaps; fetches serialised between kernels (what a tier that synchronised on the critical path
// would show) do not; another device's kernel and a kernel that only touches the copy do not count.
TEST_CASE("copy_overlap counts the copies that ran while a kernel of their device ran", "[cupti][offload]") {
  const std::vector<sbp::CuptiRecord> overlapped = {
      {sbp::CuptiKind::kernel, "layer 7 backward", 1'000, 5'000, 0, 0, 0},
      {sbp::CuptiKind::memcpy, "HtoD", 2'000, 3'000, 1 << 20, 0, 0},        // the prefetch of H[6] while layer 7 runs
      {sbp::CuptiKind::memcpy, "DtoH", 4'000, 6'000, 1 << 20, 0, 0},        // a store that outlasts the kernel
      {sbp::CuptiKind::kernel, "layer 6 backward", 6'000, 9'000, 0, 0, 0},
      {sbp::CuptiKind::memcpy, "HtoD", 7'000, 8'000, 1 << 20, 0, 0}};
  const auto in = sbp::copy_overlap(overlapped, "HtoD");
  CHECK(in.copies == 2);
  CHECK(in.overlapping == 2);
  CHECK(sbp::copy_overlap(overlapped, "DtoH").overlapping == 1);
  // Negative control: the same copies, each between two kernels.
  const std::vector<sbp::CuptiRecord> serialised = {
      {sbp::CuptiKind::kernel, "layer 7 backward", 1'000, 2'000, 0, 0, 0},
      {sbp::CuptiKind::memcpy, "HtoD", 2'000, 3'000, 1 << 20, 0, 0},        // touches both kernels, overlaps neither
      {sbp::CuptiKind::kernel, "layer 6 backward", 3'000, 4'000, 0, 0, 0},
      {sbp::CuptiKind::kernel, "another device's", 4'000, 9'000, 0, 0, 1},
      {sbp::CuptiKind::memcpy, "HtoD", 5'000, 6'000, 1 << 20, 0, 0}};
  const auto out = sbp::copy_overlap(serialised, "HtoD");
  CHECK(out.copies == 2);
  CHECK(out.overlapping == 0);
  CHECK(sbp::copy_overlap({}, "HtoD").copies == 0);
}
