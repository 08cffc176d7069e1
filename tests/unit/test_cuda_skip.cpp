// The CUDA half of the profiler skips cleanly without a GPU (these machines have none) and holds its invariants with
// one. The CUPTI timeline and writers are tested on hand-made records in test_cupti_timeline.cpp, the parsing of
// CUPTI's activity buffers in test_cupti.cpp.
#include <catch2/catch.hpp>

#include <algorithm>

#include "profiler/cuda_memory.h"
#include "profiler/cupti_recorder.h"

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

TEST_CASE("CuptiRecorder refuses to start without a GPU and then records nothing (cupti)", "[cuda][cupti]") {
  sbp::CuptiRecorder recorder;
  std::string reason;
  const bool started = recorder.start(&reason);
  INFO("reason: " << reason);
  if (!sbp::cuda_device_available()) CHECK_FALSE(started);
  if (!started) CHECK_FALSE(reason.empty());
  // With a GPU the only accepted refusal is CUPTI's own (e.g. profiling not permitted for this user), reported with
  // the CUPTI call that refused; any other reason (libcupti not found, another recorder left running) is a failure.
  if (sbp::cuda_device_available() && !started) CHECK(reason.rfind("cupti", 0) == 0);
  if (started) {
    sbp::CuptiRecorder second;
    CHECK_FALSE(second.start());  // CUPTI's callbacks are process-wide
  }
  const sbp::CuptiRecording recording = recorder.stop();
  if (!started) {
    CHECK(recording.records.empty());
    CHECK(recording.dropped_records == 0);
    CHECK(recording.unconverted_records == 0);
    CHECK(recording.unreadable_buffers == 0);
  }
  CHECK(std::is_sorted(recording.records.begin(), recording.records.end(),
                       [](const auto& a, const auto& b) { return a.start_ns < b.start_ns; }));
  CHECK(recorder.stop().records.empty());  // stopped already
}
