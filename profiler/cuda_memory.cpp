#include "profiler/cuda_memory.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>

namespace sbp {
namespace {

struct DeviceProbe {
  int count = 0;
  std::string reason;  // set when count == 0
};

// Probed once: the device count cannot change while the process runs.
const DeviceProbe& probe() {
  static const DeviceProbe result = [] {
    DeviceProbe p;
    // cudaGetDeviceCount rather than c10::cuda::device_count(): without a driver both report no device without
    // throwing (the latter is noexcept and returns 0), but only the former's error code says why.
    const cudaError_t err = cudaGetDeviceCount(&p.count);
    if (err != cudaSuccess) {
      cudaGetLastError();  // clear it, or the next CUDA call (e.g. torch's) would report our failure as its own
      p.count = 0;
      p.reason = std::string("no CUDA device: cudaGetDeviceCount failed with ") + cudaGetErrorName(err) + " (" +
                 cudaGetErrorString(err) + ")";
    } else if (p.count == 0) {
      p.reason = "no CUDA device: cudaGetDeviceCount found 0 devices";
    }
    return p;
  }();
  return result;
}

// Empty when `device` can be queried, otherwise why not.
std::string why_unusable(int device) {
  const DeviceProbe& p = probe();
  if (p.count == 0) return p.reason;
  if (device < 0 || device >= p.count)
    return "no CUDA device " + std::to_string(device) + " (found " + std::to_string(p.count) + ")";
  return {};
}

// The allocator's per-device state is created by torch's lazy CUDA init (first CUDA tensor); before that
// getDeviceStats throws "Invalid device argument: did you call init?". init() only adds the devices it does not know
// yet, so calling it ahead of torch is harmless.
void ensure_allocator_initialized() {
  auto* allocator = c10::cuda::CUDACachingAllocator::get();
  if (!allocator->initialized()) allocator->init(probe().count);
}

}  // namespace

bool cuda_device_available(std::string* reason) {
  const DeviceProbe& p = probe();
  if (p.count == 0 && reason) *reason = p.reason;
  return p.count > 0;
}

int cuda_device_count() { return probe().count; }

std::string cuda_device_name(int device) {
  if (!why_unusable(device).empty()) return {};
  cudaDeviceProp properties{};
  if (cudaGetDeviceProperties(&properties, device) != cudaSuccess) {
    cudaGetLastError();
    return {};
  }
  return properties.name;
}

void cuda_reset_peak_stats(int device) {
  if (!why_unusable(device).empty()) return;
  ensure_allocator_initialized();
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
}

CudaMemoryStats cuda_memory_stats(int device) {
  CudaMemoryStats out;
  out.reason = why_unusable(device);
  if (!out.reason.empty()) return out;
  ensure_allocator_initialized();
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  // AGGREGATE = small pool + large pool, the numbers torch.cuda.memory_allocated/max_memory_reserved report.
  constexpr auto kAggregate = static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  const auto& allocated = stats.allocated_bytes[kAggregate];
  const auto& reserved = stats.reserved_bytes[kAggregate];
  out.available = true;
  out.allocated_current_bytes = allocated.current;
  out.allocated_peak_bytes = allocated.peak;
  out.reserved_current_bytes = reserved.current;
  out.reserved_peak_bytes = reserved.peak;
  return out;
}

}  // namespace sbp
