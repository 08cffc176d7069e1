// CUDA caching-allocator memory statistics (what torch.cuda.memory_stats reports), behind a header without CUDA or
// torch includes so CPU-only code can ask. Two implementations: cuda_memory.cpp (CUDA builds) and
// cuda_memory_stub.cpp (builds without CUDA). Without a GPU nothing throws and every query says why it has no
// answer; with one, a failing CUDA call throws c10::Error like any torch CUDA call.
#pragma once

#include <cstdint>
#include <string>

namespace sbp {

struct CudaMemoryStats {
  bool available = false;
  std::string reason;  // why not available, e.g. "no CUDA device: ..."
  // Allocated = bytes held by live tensors; reserved = bytes the caching allocator got from cudaMalloc (>= allocated).
  // Peaks are since process start or the last cuda_reset_peak_stats.
  std::int64_t allocated_current_bytes = 0;
  std::int64_t allocated_peak_bytes = 0;
  std::int64_t reserved_current_bytes = 0;
  std::int64_t reserved_peak_bytes = 0;
};

// True when at least one CUDA device is usable; otherwise false and, if given, *reason says why.
bool cuda_device_available(std::string* reason = nullptr);
// Devices this process can use (0 without a driver or GPU), and a device's name ("" when it does not exist).
int cuda_device_count();
std::string cuda_device_name(int device);

// Starts a new peak window for `device`. No-op without a GPU or for a device that does not exist.
void cuda_reset_peak_stats(int device = 0);

// Aggregate (small + large pool) statistics of `device`; available=false with a reason without a GPU.
CudaMemoryStats cuda_memory_stats(int device = 0);

}  // namespace sbp
