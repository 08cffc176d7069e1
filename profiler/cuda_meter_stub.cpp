// cuda_meter.h for builds without CUDA: every meter is unavailable, with the reason, and does nothing.
#include "profiler/cuda_meter.h"

#include <map>
#include <mutex>

namespace sbp {

struct CudaMemoryMeter::State {
  int device = 0;
  std::string reason = "built without CUDA";
};

CudaMemoryMeter::CudaMemoryMeter(int device) : state_(std::make_unique<State>()) { state_->device = device; }
CudaMemoryMeter::~CudaMemoryMeter() = default;

CudaMemoryMeter& CudaMemoryMeter::for_device(int device) {
  static std::mutex mutex;
  static auto* meters = new std::map<int, CudaMemoryMeter*>();  // never destroyed, as in the CUDA build
  std::lock_guard<std::mutex> lock(mutex);
  auto& meter = (*meters)[device];
  if (!meter) meter = new CudaMemoryMeter(device);
  return *meter;
}

bool CudaMemoryMeter::available() const { return false; }
const std::string& CudaMemoryMeter::reason() const { return state_->reason; }
int CudaMemoryMeter::device() const { return state_->device; }

std::int64_t CudaMemoryMeter::current_bytes() const { return 0; }
std::int64_t CudaMemoryMeter::peak_bytes() const { return 0; }
std::int64_t CudaMemoryMeter::reserved_bytes() const { return 0; }
std::int64_t CudaMemoryMeter::reserved_peak_bytes() const { return 0; }
std::int64_t CudaMemoryMeter::largest_allocation_bytes() const { return 0; }
void CudaMemoryMeter::reset_peak() {}
void CudaMemoryMeter::set_budget_bytes(std::int64_t) {}
std::int64_t CudaMemoryMeter::budget_bytes() const { return 0; }
std::vector<PhasePeak> CudaMemoryMeter::phase_peaks() const { return {}; }

bool CudaMemoryMeter::start_timeline(std::string* reason) {
  if (reason) *reason = state_->reason;
  return false;
}
std::size_t CudaMemoryMeter::timeline_size() const { return 0; }
std::vector<MemoryEvent> CudaMemoryMeter::stop_timeline() { return {}; }
AllocatorTraceCounts CudaMemoryMeter::timeline_counts() const { return {}; }

void CudaMemoryMeter::enter_phase(const std::string&) {}
void CudaMemoryMeter::leave_phase(const std::string&) {}

}  // namespace sbp
