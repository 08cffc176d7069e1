// The CUDA memory meter (cuda_meter.h). Its pure half is checked everywhere: the trace adapter on hand-made caching-
// allocator trace entries and the budget's memory fraction. The meter itself skips cleanly without a GPU (these
// machines have none) and, with one, measures exactly what four 4 MiB tensors make it expect.
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "core/methods/phase.h"
#include "profiler/caching_allocator.h"
#include "profiler/cpu_meter.h"
#include "profiler/cuda_memory.h"
#include "profiler/cuda_meter.h"
#include "tests/support/test_support.h"

namespace {

using sbp::AllocatorTraceAdapter;
using Entry = AllocatorTraceAdapter::TraceEntry;
using Action = Entry::Action;

using sbp::test::kMiB;

Entry trace_entry(Action action, std::size_t addr, std::size_t size_bytes, c10::approx_time_t ticks, int device = 0) {
  return Entry(action, static_cast<c10::DeviceIndex>(device), addr, size_bytes, /*stream=*/nullptr,
               /*mempool=*/{0, 0}, ticks);
}

// Ticks are nanoseconds, as on a platform without a cycle counter.
std::int64_t ticks_are_ns(c10::approx_time_t ticks) { return static_cast<std::int64_t>(ticks); }

std::vector<std::int64_t> current_bytes_of(const std::vector<sbp::MemoryEvent>& events) {
  std::vector<std::int64_t> out;
  for (const auto& e : events) out.push_back(e.current_bytes);
  return out;
}


// A budget for one scope, always lifted, so that a failing check cannot leave the rest of the test under it.
class CudaBudgetScope {
 public:
  CudaBudgetScope(sbp::CudaMemoryMeter& meter, std::int64_t bytes) : meter_(meter) { meter_.set_budget_bytes(bytes); }
  ~CudaBudgetScope() { meter_.set_budget_bytes(0); }
  CudaBudgetScope(const CudaBudgetScope&) = delete;
  CudaBudgetScope& operator=(const CudaBudgetScope&) = delete;

 private:
  sbp::CudaMemoryMeter& meter_;
};

// 4 MiB of float32 on the GPU: a large-pool block, so allocated exactly (a multiple of 512 B) and traced as 4 MiB.
at::Tensor four_mib_on_gpu() { return at::empty({kMiB}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, 0)); }

}  // namespace

TEST_CASE("the CUDA meter's trace adapter adds an allocation and subtracts its completed free, not its requested one",
          "[cuda_meter]") {
  AllocatorTraceAdapter trace(0);
  trace.start(1000, 0, "");
  trace.on_trace(trace_entry(Action::ALLOC, 0xA000, 4096, 10), "");
  trace.on_trace(trace_entry(Action::ALLOC, 0xB000, 512, 20), "");
  trace.on_trace(trace_entry(Action::FREE_REQUESTED, 0xA000, 4096, 30), "");
  CHECK(trace.size() == 3);  // the start mark and two allocations: a requested free is not an event
  trace.on_trace(trace_entry(Action::FREE_COMPLETED, 0xA000, 4096, 40), "");

  const std::vector<sbp::MemoryEvent> events = trace.stop(ticks_are_ns);
  REQUIRE(events.size() == 4);
  CHECK(current_bytes_of(events) == std::vector<std::int64_t>{1000, 5096, 5608, 1512});
  CHECK(events[0].block == 0);
  CHECK(events[0].delta_bytes == 0);
  CHECK(events[1].delta_bytes == 4096);
  CHECK(events[2].delta_bytes == 512);
  CHECK(events[3].delta_bytes == -4096);
  CHECK(events[1].block != 0);
  CHECK(events[3].block == events[1].block);  // the free names the allocation it ends
  CHECK(events[2].block != events[1].block);
  CHECK_FALSE(trace.recording());
  CHECK(trace.size() == 0);
}

TEST_CASE("the CUDA meter's trace adapter subtracts a block allocated before the timeline by its traced size",
          "[cuda_meter]") {
  AllocatorTraceAdapter trace(0);
  trace.start(10'000, 0, "");
  trace.on_trace(trace_entry(Action::FREE_COMPLETED, 0xC000, 3000, 5), "");
  const auto events = trace.stop(ticks_are_ns);
  REQUIRE(events.size() == 2);
  CHECK(events[1].current_bytes == 7000);
  CHECK(events[1].delta_bytes == -3000);
  CHECK(events[1].block != 0);
}

TEST_CASE("the CUDA meter's trace adapter labels events with the phase open at the time and marks phase boundaries",
          "[cuda_meter][phase]") {
  AllocatorTraceAdapter trace(0);
  trace.start(0, 0, "");
  trace.mark(1, "forward");
  trace.on_trace(trace_entry(Action::ALLOC, 0xA000, 2048, 2), "forward");
  trace.mark(3, "");
  trace.on_trace(trace_entry(Action::FREE_COMPLETED, 0xA000, 2048, 4), "");
  const auto events = trace.stop(ticks_are_ns);
  REQUIRE(events.size() == 5);
  std::vector<std::string> phases;
  for (const auto& e : events) phases.push_back(e.phase);
  CHECK(phases == std::vector<std::string>{"", "forward", "forward", "", ""});
  CHECK(events[1].block == 0);  // a mark: no block, no change, the live bytes of the moment
  CHECK(events[1].delta_bytes == 0);
  CHECK(events[3].block == 0);
  CHECK(events[3].current_bytes == 2048);
  CHECK(events[4].current_bytes == 0);
}

TEST_CASE("the CUDA meter's timeline seconds count from its origin through the tick converter", "[cuda_meter]") {
  const c10::approx_time_t origin = 1'000'000;
  const auto record = [&](AllocatorTraceAdapter& trace) {
    trace.start(0, origin, "");
    trace.on_trace(trace_entry(Action::ALLOC, 0xA000, 512, origin + 2'500'000'000), "");
  };
  AllocatorTraceAdapter ns_ticks(0);
  record(ns_ticks);
  const auto events = ns_ticks.stop(ticks_are_ns);
  REQUIRE(events.size() == 2);
  CHECK(events[0].seconds == 0.0);
  CHECK(events[1].seconds == Approx(2.5));

  // Ticks of half a nanosecond (a 2 GHz cycle counter): the converter applies to the origin and the event alike.
  AllocatorTraceAdapter cycle_ticks(0);
  record(cycle_ticks);
  const auto halved = cycle_ticks.stop([](c10::approx_time_t t) { return static_cast<std::int64_t>(t / 2); });
  REQUIRE(halved.size() == 2);
  CHECK(halved[0].seconds == 0.0);
  CHECK(halved[1].seconds == Approx(1.25));
}

TEST_CASE("the CUDA meter's trace adapter counts segment and OOM entries as no event and ignores other devices",
          "[cuda_meter]") {
  AllocatorTraceAdapter trace(1);
  trace.start(0, 0, "");
  trace.on_trace(trace_entry(Action::SEGMENT_ALLOC, 0x10000000, 20 * kMiB, 1, 1), "");
  trace.on_trace(trace_entry(Action::SEGMENT_FREE, 0x10000000, 20 * kMiB, 2, 1), "");
  trace.on_trace(trace_entry(Action::SEGMENT_MAP, 0x20000000, 2 * kMiB, 3, 1), "");
  // OOM: addr_ is the device's free bytes, size_ the (rounded) request.
  trace.on_trace(trace_entry(Action::OOM, /*device_free=*/512 * kMiB, 1024 * kMiB, 4, 1), "");
  trace.on_trace(trace_entry(Action::ALLOC, 0xA000, 4096, 5, /*device=*/0), "");
  trace.on_trace(trace_entry(Action::SNAPSHOT, 0, 0, 6, 1), "");
  CHECK(trace.size() == 1);  // the start mark only
  CHECK(trace.largest_allocation_bytes() == 0);  // device 0's allocation is not this adapter's

  const sbp::AllocatorTraceCounts counts = trace.counts();
  CHECK(counts.segment_allocs == 2);
  CHECK(counts.segment_frees == 1);
  CHECK(counts.reserved_delta_bytes == 2 * kMiB);
  CHECK(counts.ooms == 1);
  CHECK(counts.oom_requested_bytes == 1024 * kMiB);

  const auto events = trace.stop(ticks_are_ns);
  REQUIRE(events.size() == 1);
  CHECK(events[0].current_bytes == 0);
  CHECK(trace.counts().ooms == 1);  // kept after the stop
  trace.start(0, 0, "");
  CHECK(trace.counts().ooms == 0);  // a new timeline counts afresh
}

TEST_CASE("the CUDA meter's trace adapter keeps the largest request whether or not a timeline runs",
          "[cuda_meter]") {
  AllocatorTraceAdapter trace(0);
  trace.on_trace(trace_entry(Action::ALLOC, 0xA000, 3 * kMiB, 1), "");
  trace.on_trace(trace_entry(Action::ALLOC, 0xB000, kMiB, 2), "");
  CHECK(trace.size() == 0);  // no timeline: no events
  CHECK(trace.largest_allocation_bytes() == 3 * kMiB);
  trace.reset_largest();
  CHECK(trace.largest_allocation_bytes() == 0);
  trace.start(0, 0, "");
  trace.on_trace(trace_entry(Action::ALLOC, 0xC000, 512, 3), "");
  CHECK(trace.largest_allocation_bytes() == 512);
}

TEST_CASE("the CUDA meter's budget fraction makes torch's limit exactly the budget", "[cuda_meter]") {
  // 80 GiB, an H100's totalGlobalMem, 24 GiB, 16 GB and an odd size.
  const std::vector<std::size_t> totals = {85'899'345'920, 85'029'158'912, 25'769'803'776, 16'000'000'000,
                                           12'345'678'901};
  for (const std::size_t total : totals) {
    const auto t = static_cast<std::int64_t>(total);
    for (const std::int64_t budget : {std::int64_t(1), std::int64_t(512), kMiB, std::int64_t(1'000'000'007),
                                      t / 3, t / 2 + 1, t - 1}) {
      const double fraction = sbp::memory_fraction_for_budget(budget, total);
      INFO("total " << total << ", budget " << budget << ", fraction " << fraction);
      CHECK(fraction > 0.0);
      CHECK(fraction < 1.0);
      // torch 2.14's setMemoryFraction: allowed_memory_maximum = size_t(fraction * double(totalGlobalMem)).
      CHECK(static_cast<std::size_t>(fraction * static_cast<double>(total)) == static_cast<std::size_t>(budget));
    }
    CHECK(sbp::memory_fraction_for_budget(0, total) == 1.0);  // no budget
    CHECK(sbp::memory_fraction_for_budget(-5, total) == 1.0);
    CHECK(sbp::memory_fraction_for_budget(t, total) == 1.0);  // the whole device: no limit
    CHECK(sbp::memory_fraction_for_budget(t + 1, total) == 1.0);
  }
}

TEST_CASE("the CUDA meter without a GPU is unavailable with a reason and does nothing, without throwing",
          "[cuda][cuda_meter]") {
  auto& meter = sbp::CudaMemoryMeter::for_device(0);
  CHECK(&meter == &sbp::CudaMemoryMeter::for_device(0));  // one per device
  CHECK(meter.device() == 0);
  CHECK(meter.available() == sbp::cuda_device_available());
  if (meter.available()) {
    CHECK(meter.reason().empty());
    return;  // the GPU case below checks the rest
  }
  INFO("reason: " << meter.reason());
  CHECK_FALSE(meter.reason().empty());
  CHECK_NOTHROW(meter.reset_peak());
  CHECK_NOTHROW(meter.set_budget_bytes(64 * kMiB));
  CHECK(meter.budget_bytes() == 0);  // not applied, and it says so
  CHECK(meter.current_bytes() == 0);
  CHECK(meter.peak_bytes() == 0);
  CHECK(meter.reserved_bytes() == 0);
  CHECK(meter.reserved_peak_bytes() == 0);
  CHECK(meter.largest_allocation_bytes() == 0);

  std::string reason;
  CHECK_FALSE(meter.start_timeline(&reason));
  CHECK(reason == meter.reason());
  CHECK_FALSE(meter.start_timeline());  // the reason pointer is optional
  {
    sbp::PhaseListenerScope listen(meter);
    sbp::PhaseClock clock;
    CHECK_NOTHROW(sbp::Phase(clock, "forward"));
  }
  CHECK(meter.phase_peaks().empty());
  CHECK(meter.timeline_size() == 0);
  CHECK(meter.stop_timeline().empty());
  CHECK(meter.timeline_counts().ooms == 0);
}

TEST_CASE("the CUDA meter of a device that does not exist is unavailable with a reason", "[cuda][cuda_meter]") {
  auto& meter = sbp::CudaMemoryMeter::for_device(1000);
  CHECK_FALSE(meter.available());
  CHECK_FALSE(meter.reason().empty());
  CHECK(meter.device() == 1000);
  CHECK_FALSE(meter.start_timeline());
  CHECK(meter.peak_bytes() == 0);
}

TEST_CASE("with a GPU the meter's peaks are exact per phase and its timeline sees every tensor",
          "[cuda][cuda_meter][phase][needs-gpu]") {
  auto& meter = sbp::CudaMemoryMeter::for_device(0);
  if (!meter.available()) {  // CTest reports the skip (SKIP_REGULAR_EXPRESSION); the case without a GPU ran above
    WARN("SKIPPED: no GPU: " << meter.reason());
    return;
  }
  four_mib_on_gpu();  // the first CUDA tensor sets up torch's CUDA state: not part of what is measured
  sbp::PhaseClock clock;
  std::vector<sbp::MemoryEvent> events;
  meter.reset_peak();
  const std::int64_t base = meter.current_bytes();
  {
    sbp::PhaseListenerScope listen(meter);
    REQUIRE(meter.start_timeline());
    {
      sbp::Phase outer(clock, "outer");
      { const auto a = four_mib_on_gpu(), b = four_mib_on_gpu(); }
      sbp::Phase inner(clock, "inner");  // opens after a and b are gone: must not see them
      const auto c = four_mib_on_gpu();
    }
    events = meter.stop_timeline();
  }
  CHECK(meter.peak_bytes() - base == 8 * kMiB);
  CHECK(meter.current_bytes() == base);
  CHECK(meter.largest_allocation_bytes() == 4 * kMiB);
  const auto peaks = meter.phase_peaks();
  const sbp::PhasePeak* outer = sbp::test::find_phase(peaks, "outer");
  const sbp::PhasePeak* inner = sbp::test::find_phase(peaks, "inner");
  REQUIRE(outer != nullptr);
  REQUIRE(inner != nullptr);
  CHECK(outer->peak_bytes - base == 8 * kMiB);
  CHECK(inner->peak_bytes - base == 4 * kMiB);
  CHECK(inner->count == 1);

  REQUIRE_FALSE(events.empty());
  std::int64_t net = 0, highest = events.front().current_bytes;
  int inner_allocations = 0;
  for (const auto& e : events) {
    net += e.delta_bytes;
    highest = std::max(highest, e.current_bytes);
    if (e.phase == "inner" && e.delta_bytes > 0) ++inner_allocations;
  }
  CHECK(net == 0);  // everything allocated in the timeline was freed in it
  CHECK(highest - events.front().current_bytes == 8 * kMiB);
  CHECK(inner_allocations == 1);
  CHECK(std::is_sorted(events.begin(), events.end(),
                       [](const auto& x, const auto& y) { return x.seconds < y.seconds; }));
}

TEST_CASE("with a GPU the CUDA meter's budget makes an allocation beyond it throw OutOfMemoryError",
          "[cuda][cuda_meter][needs-gpu]") {
  auto& meter = sbp::CudaMemoryMeter::for_device(0);
  if (!meter.available()) {  // CTest reports the skip (SKIP_REGULAR_EXPRESSION); the case without a GPU ran above
    WARN("SKIPPED: no GPU: " << meter.reason());
    return;
  }
  // Limits reserved bytes: 64 MiB above what is reserved now fits a 16 MiB tensor (a 16 MiB segment) but not one
  // larger than everything reserved plus 64 MiB, even after the allocator returns its cache to CUDA.
  const std::int64_t reserved = meter.reserved_bytes();
  const auto floats = [](std::int64_t bytes) {
    return at::empty({bytes / 4}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, 0));
  };
  REQUIRE(meter.start_timeline());
  {
    CudaBudgetScope budget(meter, reserved + 64 * kMiB);
    CHECK(meter.budget_bytes() == reserved + 64 * kMiB);
    CHECK_NOTHROW(floats(16 * kMiB));
    CHECK_THROWS_AS(floats(reserved + 128 * kMiB), c10::OutOfMemoryError);
  }
  meter.stop_timeline();
  CHECK(meter.timeline_counts().ooms == 1);
  CHECK(meter.budget_bytes() == 0);
  CHECK_NOTHROW(floats(reserved + 128 * kMiB));  // lifted
}
