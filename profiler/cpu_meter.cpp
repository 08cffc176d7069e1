#include "profiler/cpu_meter.h"

#include "profiler/chrome_trace.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <mutex>
#include <ostream>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

namespace sbp {
namespace {

struct OpenPhase {
  std::string name;
  std::size_t slot;  // index into State::peaks
};

// All meter state behind one mutex: allocations come from every intra-op thread.
struct State {
  std::mutex mutex;
  struct Block {
    std::size_t size;
    std::uint64_t id;  // allocation number, for the timeline
    int thread;        // the allocating thread (thread_index)
    std::uint64_t window;  // the reset_peak window it was allocated in
  };
  std::unordered_map<void*, Block> sizes;  // live blocks allocated through the wrapper
  std::uint64_t next_id = 1;
  std::int64_t current = 0, peak = 0, budget = 0, outside_budget = 0, largest = 0;
  // Per allocating thread, bytes allocated in this window and still alive, and their peak: what each thread held at
  // its own worst moment (coincident_peak_bytes).
  std::uint64_t window = 0;
  std::vector<std::int64_t> thread_current, thread_peak;
  std::vector<OpenPhase> open;
  std::vector<PhasePeak> peaks;
  bool recording = false;
  std::chrono::steady_clock::time_point timeline_start;
  std::vector<MemoryEvent> timeline;

  void record_event(std::uint64_t block = 0, std::int64_t delta = 0) {
    if (!recording) return;
    timeline.push_back({std::chrono::duration<double>(std::chrono::steady_clock::now() - timeline_start).count(),
                        current, open.empty() ? std::string() : open.back().name, block, delta});
  }
};

State& state() {
  static State* s = new State();  // never destroyed: tensors may be freed during static destruction
  return *s;
}

// A small number per OS thread, in the order threads first allocate (OpenMP's workers live for the process).
int thread_index() {
  static std::atomic<int> next{0};
  thread_local const int index = next++;
  return index;
}

void tracked_free(void* ptr) {
  if (!ptr) return;
  auto& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    // A block from before install (oneDNN frees raw_allocate'd blocks through the current allocator) is unknown:
    // free it without counting.
    if (auto it = s.sizes.find(ptr); it != s.sizes.end()) {
      s.current -= std::int64_t(it->second.size);
      if (it->second.window == s.window) s.thread_current[it->second.thread] -= std::int64_t(it->second.size);
      s.record_event(it->second.id, -std::int64_t(it->second.size));
      s.sizes.erase(it);
    }
  }
  c10::free_cpu(ptr);
}

// data == context (c10 relies on it for CPU tensors), raw_deleter provided, copy_data overridden (ARCHITECTURE.md §7).
class TrackingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(std::size_t n) override {
    if (n == 0) return {nullptr, nullptr, &tracked_free, c10::Device(c10::DeviceType::CPU)};
    auto& s = state();
    const auto thread = thread_index();
    State::Block block{n, 0, thread, 0};
    {
      // The budget check and the count in one critical section: two threads can never both pass the check with
      // room for one of them (the bytes are counted before the memory exists, and uncounted if malloc fails).
      std::lock_guard<std::mutex> lock(s.mutex);
      if (s.budget > 0 && s.current + std::int64_t(n) > s.budget + s.outside_budget)
        TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU memory budget exceeded: ", s.current - s.outside_budget,
                         " bytes counted + ", n, " requested > budget of ", s.budget, " bytes",
                         s.outside_budget ? " (" + std::to_string(s.outside_budget) +
                                                " bytes held before the step, not the model's, are outside it)"
                                          : std::string());
      block.id = s.next_id++;
      block.window = s.window;
      s.current += std::int64_t(n);
      if (std::size_t(thread) >= s.thread_current.size()) {
        s.thread_current.resize(thread + 1, 0);
        s.thread_peak.resize(thread + 1, 0);
      }
      s.thread_current[thread] += std::int64_t(n);
      s.thread_peak[thread] = std::max(s.thread_peak[thread], s.thread_current[thread]);
      s.peak = std::max(s.peak, s.current);
      s.largest = std::max(s.largest, std::int64_t(n));
      for (const auto& p : s.open) s.peaks[p.slot].peak_bytes = std::max(s.peaks[p.slot].peak_bytes, s.current);
      s.record_event(block.id, std::int64_t(n));
    }
    void* ptr = nullptr;
    try {
      ptr = c10::alloc_cpu(n);
    } catch (const c10::Error&) {
      std::int64_t live = 0;
      {
        std::lock_guard<std::mutex> lock(s.mutex);
        s.current -= std::int64_t(n);
        if (block.window == s.window) s.thread_current[thread] -= std::int64_t(n);
        s.record_event(block.id, -std::int64_t(n));
        live = s.current;
      }
      // malloc failed (ulimit -v, a cgroup limit, no overcommit): out of memory as a full device is, so that every
      // command reports it as `oom` (exit 3) and names the block, not as a generic c10::Error (exit 2, issue #44).
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU out of memory: the system refused an allocation of ", n,
                       " bytes (", live, " bytes live in tensors)");
    }
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      s.sizes.emplace(ptr, block);
    }
    return {ptr, ptr, &tracked_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &tracked_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};

}  // namespace

CpuMemoryMeter& CpuMemoryMeter::install() {
  static CpuMemoryMeter* meter = [] {
    static TrackingAllocator allocator;
    // Priority above the default CPU allocator's, so nothing registered later at default priority replaces us.
    c10::SetCPUAllocator(&allocator, /*priority=*/100);
    auto* m = new CpuMemoryMeter();
    set_phase_listener(m);
    return m;
  }();
  return *meter;
}

std::int64_t CpuMemoryMeter::current_bytes() const {
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().current;
}

std::int64_t CpuMemoryMeter::peak_bytes() const {
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().peak;
}

void CpuMemoryMeter::reset_peak() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.peak = s.current;
  s.largest = 0;
  s.peaks.clear();
  s.open.clear();
  ++s.window;
  std::fill(s.thread_current.begin(), s.thread_current.end(), 0);
  std::fill(s.thread_peak.begin(), s.thread_peak.end(), 0);
}

std::int64_t CpuMemoryMeter::coincident_peak_bytes() const {
  std::lock_guard<std::mutex> lock(state().mutex);
  std::int64_t sum = 0;
  for (const auto p : state().thread_peak) sum += p;
  return sum;
}

std::int64_t CpuMemoryMeter::largest_allocation_bytes() const {
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().largest;
}

void CpuMemoryMeter::set_budget_bytes(std::int64_t bytes, std::int64_t outside_bytes) {
  std::lock_guard<std::mutex> lock(state().mutex);
  state().budget = std::max<std::int64_t>(0, bytes);
  state().outside_budget = state().budget > 0 ? std::max<std::int64_t>(0, outside_bytes) : 0;
}

std::int64_t CpuMemoryMeter::budget_bytes() const {
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().budget;
}

std::vector<PhasePeak> CpuMemoryMeter::phase_peaks() const {
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().peaks;
}

void CpuMemoryMeter::enter_phase(const std::string& name) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = std::find_if(s.peaks.begin(), s.peaks.end(), [&](const PhasePeak& p) { return p.name == name; });
  if (it == s.peaks.end()) it = s.peaks.insert(s.peaks.end(), PhasePeak{name, 0, 0});
  it->peak_bytes = std::max(it->peak_bytes, s.current);
  ++it->count;
  s.open.push_back({name, std::size_t(it - s.peaks.begin())});
  s.record_event();
}

void CpuMemoryMeter::leave_phase(const std::string& name) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.open.empty() && s.open.back().name == name) s.open.pop_back();
  s.record_event();
}

void CpuMemoryMeter::start_timeline() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.timeline.clear();
  s.timeline_start = std::chrono::steady_clock::now();
  s.recording = true;
  s.record_event();
}

std::size_t CpuMemoryMeter::timeline_size() const {
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().timeline.size();
}

std::vector<MemoryEvent> CpuMemoryMeter::stop_timeline() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.recording = false;
  return std::move(s.timeline);
}

namespace {
std::int64_t proc_status_kib(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1)) * 1024;
  return -1;
}
}  // namespace

std::int64_t process_peak_rss_bytes() { return proc_status_kib("VmHWM"); }
std::int64_t process_rss_bytes() { return proc_status_kib("VmRSS"); }

void write_timeline_csv(const std::vector<MemoryEvent>& events, std::ostream& out) {
  out << "seconds,current_bytes,phase,block,delta_bytes\n";
  for (const auto& e : events)
    out << e.seconds << ',' << e.current_bytes << ',' << e.phase << ',' << e.block << ',' << e.delta_bytes << '\n';
}

void write_timeline_chrome_trace(const std::vector<MemoryEvent>& events, std::ostream& out) {
  write_counter_chrome_trace(events, [](const MemoryEvent& e) { return nlohmann::json{{"bytes", e.current_bytes}}; }, out);
}

}  // namespace sbp
