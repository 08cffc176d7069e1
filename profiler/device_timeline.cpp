#include "profiler/device_timeline.h"

#include <sstream>
#include <stdexcept>

#include <fmt/format.h>

#include "core/io/safetensors.h"  // write_file_atomically
#include "profiler/cpu_meter.h"
#include "profiler/cuda_meter.h"
#include "profiler/cupti_recorder.h"
#include "core/io/input_error.h"

namespace sbp {

struct DeviceTimeline::State {
  State(c10::Device d, TimelineSource s) : device(d), source(s) {}
  c10::Device device;
  TimelineSource source;
  CuptiRecorder cupti;
};

DeviceTimeline::DeviceTimeline(c10::Device device, TimelineSource source)
    : state_(std::make_unique<State>(device, source)) {
  std::string reason;
  switch (source) {
    case TimelineSource::none: break;
    case TimelineSource::allocator:
      if (!device.is_cuda()) {
        CpuMemoryMeter::install().start_timeline();
      } else if (!CudaMemoryMeter::for_device(device.index()).start_timeline(&reason)) {
        throw InputError("--timeline on " + device.str() + ": " + reason);
      }
      break;
    case TimelineSource::cupti:
      if (!device.is_cuda()) throw InputError("--profile cupti needs a CUDA device");
      if (!state_->cupti.start(&reason)) throw InputError("--profile cupti: " + reason);
      break;
  }
}

DeviceTimeline::~DeviceTimeline() = default;

void DeviceTimeline::stop_and_write(const std::string& prefix) {
  const auto& s = *state_;
  std::ostringstream csv, trace;
  switch (s.source) {
    case TimelineSource::none: return;
    case TimelineSource::allocator: {
      std::vector<MemoryEvent> events;
      if (!s.device.is_cuda()) {
        events = CpuMemoryMeter::install().stop_timeline();
      } else {
        auto& meter = CudaMemoryMeter::for_device(s.device.index());
        events = meter.stop_timeline();
        const auto counts = meter.timeline_counts();
        fmt::print("timeline  caching allocator: {} segment allocations, {} segment frees, {} OOMs\n",
                   counts.segment_allocs, counts.segment_frees, counts.ooms);
      }
      write_timeline_csv(events, csv);
      write_timeline_chrome_trace(events, trace);
      break;
    }
    case TimelineSource::cupti: {
      const CuptiRecording recording = state_->cupti.stop();
      std::ostringstream records;
      write_cupti_csv(recording, records);
      write_file_atomically(prefix + ".cupti.csv", records.str());
      write_timeline_csv(cupti_memory_timeline(recording.records, s.device.index()).events, csv);
      write_cupti_chrome_trace(recording, trace);
      fmt::print("timeline  CUPTI: {} records; {}\n", recording.records.size(), cupti_losses(recording));
      // An offload tier's fetches: whether they ran beside the kernels (ARCHITECTURE.md §15) or held them back.
      for (const auto* direction : {"HtoD", "DtoH"})
        if (const auto o = copy_overlap(recording.records, direction); o.copies > 0)
          fmt::print("timeline  CUPTI: {} {} copies, {} of them while a kernel ran\n", o.copies, direction,
                     o.overlapping);
      break;
    }
  }
  write_file_atomically(prefix + ".csv", csv.str());
  write_file_atomically(prefix + ".trace.json", trace.str());
}

}  // namespace sbp
