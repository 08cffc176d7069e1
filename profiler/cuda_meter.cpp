#include "profiler/cuda_meter.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <string_view>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include "profiler/caching_allocator.h"
#include "profiler/cuda_memory.h"

namespace sbp {

// Lock order: a device's allocator lock, then State::mutex (the trace callback runs under the former). So nothing
// below calls into the allocator while holding State::mutex.
struct CudaMemoryMeter::State {
  struct OpenPhase {
    std::string name;
    std::size_t slot;  // index into peaks
  };
  int device = 0;
  std::string reason;  // empty when available
  std::mutex mutex;
  std::int64_t peak = 0, reserved_peak = 0;  // folded from the allocator's windows since reset_peak()
  std::int64_t budget = 0;
  std::optional<double> fraction_before_budget;  // what set_budget_bytes(0) restores
  std::vector<OpenPhase> open;
  std::vector<PhasePeak> peaks;
  AllocatorTraceAdapter trace;
  bool trace_attached = false;
  std::string trace_reason;  // why not attached
  std::optional<c10::ApproximateClockToUnixTimeConverter> clock;  // of the running timeline

  explicit State(int d) : device(d), trace(d) {}
  std::string_view innermost_phase() const { return open.empty() ? std::string_view() : open.back().name; }
  c10::DeviceIndex index() const { return static_cast<c10::DeviceIndex>(device); }
};

namespace {

using c10::CachingAllocator::StatType;
constexpr auto kAggregate = static_cast<std::size_t>(StatType::AGGREGATE);

// The trace callback finds a device's state here without a lock (a lock would have to be taken under the allocator's).
// 128 = every c10::DeviceIndex.
std::array<std::atomic<CudaMemoryMeter::State*>, 128> g_states{};

void on_allocator_trace(const c10::CachingDeviceAllocator::TraceEntry& entry) {
  if (entry.device_ < 0) return;
  CudaMemoryMeter::State* s = g_states[std::size_t(entry.device_)].load(std::memory_order_acquire);
  if (!s) return;
  std::lock_guard<std::mutex> lock(s->mutex);
  s->trace.on_trace(entry, s->innermost_phase());
}

// As in cuda_memory.cpp: the allocator's per-device state exists only after torch's lazy CUDA init; init() only adds
// the devices it does not know yet, so calling it ahead of torch is harmless.
void ensure_meter_allocator() {
  auto* allocator = c10::cuda::CUDACachingAllocator::get();
  if (!allocator->initialized()) allocator->init(cuda_device_count());
}

// Attached once per process, for every device. Empty when attached, else why not (the cudaMallocAsync backend
// refuses: "cudaMallocAsync does not yet support attachAllocatorTraceTracker").
const std::string& attach_trace_callback() {
  static const std::string reason = [] {
    try {
      c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker(&on_allocator_trace);
      return std::string();
    } catch (const c10::Error& e) {
      return std::string("the CUDA allocator's trace callback cannot be attached: ") + e.what_without_backtrace();
    }
  }();
  return reason;
}

struct Window {
  std::int64_t allocated_current, allocated_peak, reserved_current, reserved_peak;
};

Window read_window(c10::DeviceIndex device) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
  const auto& allocated = stats.allocated_bytes[kAggregate];
  const auto& reserved = stats.reserved_bytes[kAggregate];
  return {allocated.current, allocated.peak, reserved.current, reserved.peak};
}

// The overall peak of one quantity: the largest of the folded windows' and the open window's.
std::int64_t overall_peak(CudaMemoryMeter::State& s, std::int64_t CudaMemoryMeter::State::*folded,
                          std::int64_t Window::*open) {
  const Window w = read_window(s.index());
  std::lock_guard<std::mutex> lock(s.mutex);
  return std::max(s.*folded, w.*open);
}

// The window since the last boundary, and a new one from now (resetPeakStats: peak := current).
Window take_window(c10::DeviceIndex device) {
  const Window window = read_window(device);
  c10::cuda::CUDACachingAllocator::resetPeakStats(device);
  return window;
}

// Under s.mutex: the window's peaks belong to the overall peaks and to every phase open during it.
void fold(CudaMemoryMeter::State& s, const Window& w) {
  s.peak = std::max(s.peak, w.allocated_peak);
  s.reserved_peak = std::max(s.reserved_peak, w.reserved_peak);
  for (const auto& p : s.open) s.peaks[p.slot].peak_bytes = std::max(s.peaks[p.slot].peak_bytes, w.allocated_peak);
}

}  // namespace

CudaMemoryMeter::CudaMemoryMeter(int device) : state_(std::make_unique<State>(device)) {
  State& s = *state_;
  if (!cuda_device_available(&s.reason)) return;
  if (device < 0 || device >= cuda_device_count()) {
    s.reason = "no CUDA device " + std::to_string(device) + " (found " + std::to_string(cuda_device_count()) + ")";
    return;
  }
  ensure_meter_allocator();
  s.trace_reason = attach_trace_callback();
  s.trace_attached = s.trace_reason.empty();
  g_states[std::size_t(device)].store(&s, std::memory_order_release);
  reset_peak();  // peaks from before the meter are not its own
}

CudaMemoryMeter::~CudaMemoryMeter() = default;

CudaMemoryMeter& CudaMemoryMeter::for_device(int device) {
  static std::mutex mutex;
  static auto* meters = new std::map<int, CudaMemoryMeter*>();  // never destroyed: the trace callback outlives main
  std::lock_guard<std::mutex> lock(mutex);
  auto& meter = (*meters)[device];
  if (!meter) meter = new CudaMemoryMeter(device);
  return *meter;
}

bool CudaMemoryMeter::available() const { return state_->reason.empty(); }
const std::string& CudaMemoryMeter::reason() const { return state_->reason; }
int CudaMemoryMeter::device() const { return state_->device; }

std::int64_t CudaMemoryMeter::current_bytes() const {
  if (!available()) return 0;
  return read_window(state_->index()).allocated_current;
}

std::int64_t CudaMemoryMeter::peak_bytes() const {
  return available() ? overall_peak(*state_, &State::peak, &Window::allocated_peak) : 0;
}

std::int64_t CudaMemoryMeter::reserved_bytes() const {
  if (!available()) return 0;
  return read_window(state_->index()).reserved_current;
}

std::int64_t CudaMemoryMeter::reserved_peak_bytes() const {
  return available() ? overall_peak(*state_, &State::reserved_peak, &Window::reserved_peak) : 0;
}

std::int64_t CudaMemoryMeter::largest_allocation_bytes() const {
  if (!available()) return 0;
  if (!state_->trace_attached) return -1;
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->trace.largest_allocation_bytes();
}

void CudaMemoryMeter::reset_peak() {
  if (!available()) return;
  State& s = *state_;
  c10::cuda::CUDACachingAllocator::resetPeakStats(s.index());
  const Window w = read_window(s.index());  // after the reset: peaks are the current values
  std::lock_guard<std::mutex> lock(s.mutex);
  s.peak = w.allocated_peak;
  s.reserved_peak = w.reserved_peak;
  s.trace.reset_largest();
  s.peaks.clear();
  s.open.clear();
}

void CudaMemoryMeter::set_budget_bytes(std::int64_t bytes) {
  if (!available()) return;
  State& s = *state_;
  bytes = std::max<std::int64_t>(0, bytes);
  std::optional<double> before;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    before = s.fraction_before_budget;
  }
  if (!before) before = c10::cuda::CUDACachingAllocator::getMemoryFraction(s.index());
  double fraction = *before;
  if (bytes > 0) {
    // totalGlobalMem: what torch 2.14's setMemoryFraction multiplies the fraction by.
    cudaDeviceProp properties{};
    const cudaError_t err = cudaGetDeviceProperties(&properties, s.device);
    TORCH_CHECK(err == cudaSuccess, "cudaGetDeviceProperties(", s.device, ") failed: ", cudaGetErrorString(err));
    fraction = memory_fraction_for_budget(bytes, properties.totalGlobalMem);
  }
  c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, s.index());
  std::lock_guard<std::mutex> lock(s.mutex);
  s.budget = bytes;
  s.fraction_before_budget = bytes > 0 ? before : std::nullopt;
}

std::int64_t CudaMemoryMeter::budget_bytes() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->budget;
}

std::vector<PhasePeak> CudaMemoryMeter::phase_peaks() const {
  if (!available()) return {};
  const Window w = read_window(state_->index());
  std::lock_guard<std::mutex> lock(state_->mutex);
  std::vector<PhasePeak> peaks = state_->peaks;
  for (const auto& p : state_->open) peaks[p.slot].peak_bytes = std::max(peaks[p.slot].peak_bytes, w.allocated_peak);
  return peaks;
}

void CudaMemoryMeter::enter_phase(const std::string& name) {
  if (!available()) return;
  State& s = *state_;
  const Window w = take_window(s.index());  // before the phase opens: the window belongs to the enclosing phases
  const auto ticks = c10::getApproximateTime();
  std::lock_guard<std::mutex> lock(s.mutex);
  fold(s, w);
  auto it = std::find_if(s.peaks.begin(), s.peaks.end(), [&](const PhasePeak& p) { return p.name == name; });
  if (it == s.peaks.end()) it = s.peaks.insert(s.peaks.end(), PhasePeak{name, 0, 0});
  it->peak_bytes = std::max(it->peak_bytes, w.allocated_current);
  ++it->count;
  s.open.push_back({name, std::size_t(it - s.peaks.begin())});
  s.trace.mark(ticks, name);
}

void CudaMemoryMeter::leave_phase(const std::string& name) {
  if (!available()) return;
  State& s = *state_;
  const Window w = take_window(s.index());  // the leaving phase is still open: the window is partly its
  const auto ticks = c10::getApproximateTime();
  std::lock_guard<std::mutex> lock(s.mutex);
  fold(s, w);
  if (!s.open.empty() && s.open.back().name == name) s.open.pop_back();
  s.trace.mark(ticks, s.innermost_phase());
}

bool CudaMemoryMeter::start_timeline(std::string* reason) {
  State& s = *state_;
  const std::string& why = !available() ? s.reason : s.trace_reason;
  if (!why.empty()) {
    if (reason) *reason = why;
    return false;
  }
  // The converter measures (unix time, ticks) pairs now and again at the stop; the timeline's origin comes after
  // the first pairs, so every tick it converts lies between or after them.
  c10::ApproximateClockToUnixTimeConverter clock;
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(s.index());
  const auto origin = c10::getApproximateTime();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.clock = std::move(clock);
  s.trace.start(stats.requested_bytes[kAggregate].current, origin, s.innermost_phase());
  return true;
}

std::size_t CudaMemoryMeter::timeline_size() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->trace.size();
}

std::vector<MemoryEvent> CudaMemoryMeter::stop_timeline() {
  State& s = *state_;
  std::optional<c10::ApproximateClockToUnixTimeConverter> clock;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (!s.trace.recording()) return {};
    clock = std::move(s.clock);
    s.clock.reset();
  }
  const auto ticks_to_ns = clock->makeConverter();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.trace.stop(ticks_to_ns);
}

AllocatorTraceCounts CudaMemoryMeter::timeline_counts() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->trace.counts();
}

}  // namespace sbp
