// cuda_memory.h for builds without CUDA: no device, ever.
#include "profiler/cuda_memory.h"

namespace sbp {
namespace {
constexpr const char* kNoCuda = "built without CUDA";
}

bool cuda_device_available(std::string* reason) {
  if (reason) *reason = kNoCuda;
  return false;
}

int cuda_device_count() { return 0; }
std::string cuda_device_name(int) { return {}; }

void cuda_reset_peak_stats(int) {}

CudaMemoryStats cuda_memory_stats(int) {
  CudaMemoryStats out;
  out.reason = kNoCuda;
  return out;
}

}  // namespace sbp
