// The memory timeline of a run on any device, in one format (cpu_meter.h's MemoryEvent CSV and Chrome trace):
//   allocator, CPU   every tensor byte, from the CPU meter
//   allocator, CUDA  every tensor block the caching allocator hands out or takes back (its trace callback)
//   cupti (CUDA)     every cudaMalloc/cudaFree of the allocator's segments, i.e. reserved memory, from CUPTI's
//                    activity records, with kernels and copies as slices in the trace and every record in
//                    PREFIX.cupti.csv; records CUPTI dropped are counted and printed, never silently lost.
// CUPTI is never active together with another profiler (cupti_recorder.h); `run` refuses --op-profile with it.
#pragma once

#include <memory>
#include <string>

#include <c10/core/Device.h>

namespace sbp {

enum class TimelineSource { none, allocator, cupti };

class DeviceTimeline {
 public:
  // Starts recording; throws std::runtime_error with the reason when the device's recorder refuses (no GPU, no
  // libcupti, another recorder running).
  DeviceTimeline(c10::Device device, TimelineSource source);
  ~DeviceTimeline();
  DeviceTimeline(const DeviceTimeline&) = delete;
  DeviceTimeline& operator=(const DeviceTimeline&) = delete;

  // Stops and writes PREFIX.csv and PREFIX.trace.json (and PREFIX.cupti.csv for CUPTI), each atomically; prints what
  // the recorder could not see (dropped records, allocator OOMs). Nothing for TimelineSource::none.
  void stop_and_write(const std::string& prefix);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace sbp
