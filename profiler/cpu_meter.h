// CPU memory meter: an allocator wrapper that sees every byte a CPU tensor allocates (ARCHITECTURE.md §7). Current and peak
// bytes, per-phase peaks (it listens to the Phase marks of the BP methods), an optional budget that throws
// c10::OutOfMemoryError like a full GPU would (as does a block the system refuses), and an optional timeline of
// (time, bytes, phase).
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "core/methods/phase.h"

namespace sbp {

struct PhasePeak {
  std::string name;
  std::int64_t peak_bytes = 0;  // highest live bytes while the phase was open (all its entries)
  int count = 0;
};

struct MemoryEvent {
  double seconds = 0;            // since the timeline started
  std::int64_t current_bytes = 0;
  std::string phase;             // innermost open phase, "" outside any
  std::uint64_t block = 0;       // the allocation this event allocates or frees (0: a phase mark)
  std::int64_t delta_bytes = 0;  // +size on allocation, -size on free, 0 for a phase mark
};

class CpuMemoryMeter final : public PhaseListener {
 public:
  // Installs the wrapper as the CPU allocator (once per process; later calls return the same meter) and starts
  // listening to phases. Call it before any tensor exists: blocks allocated earlier are never counted (freeing
  // them through the wrapper is fine).
  static CpuMemoryMeter& install();

  std::int64_t current_bytes() const;
  std::int64_t peak_bytes() const;
  // Largest single block allocated since the last reset_peak(): proves that no [T, T] tile was ever made.
  std::int64_t largest_allocation_bytes() const;
  void reset_peak();  // peak := current; also clears the phase peaks and the largest allocation
  // Bytes allocated since reset_peak() if every thread's own peak (of the blocks it allocated, still alive) had come
  // at the same moment: the worst case of a parallel kernel whose workers each take scratch, which a long call
  // reaches and a short probe may not (kernel calibration: 2 x 354 KiB of oneDNN scratch in a bf16 flash backward
  // coincide at T = 2048 and not at T = 1024).
  std::int64_t coincident_peak_bytes() const;
  // Allocations that would take live bytes above `bytes` throw c10::OutOfMemoryError; 0 = no budget. `outside_bytes`
  // are live now and not the budget's (a measurement's: held before the step, not the model's): the limit is their sum,
  // and the error names the budget as given. An allocation the system refuses (malloc fails: ulimit -v, a cgroup
  // limit) throws c10::OutOfMemoryError too, naming its size, budget or not.
  void set_budget_bytes(std::int64_t bytes, std::int64_t outside_bytes = 0);
  std::int64_t budget_bytes() const;
  std::vector<PhasePeak> phase_peaks() const;

  void start_timeline();  // clears and records every allocation and free from now on
  std::size_t timeline_size() const;  // events recorded so far
  std::vector<MemoryEvent> stop_timeline();

  void enter_phase(const std::string& name) override;
  void leave_phase(const std::string& name) override;

  CpuMemoryMeter(const CpuMemoryMeter&) = delete;
  CpuMemoryMeter& operator=(const CpuMemoryMeter&) = delete;

 private:
  CpuMemoryMeter() = default;
};

// Peak resident set size of this process (VmHWM), in bytes; -1 when /proc is not readable.
std::int64_t process_peak_rss_bytes();
std::int64_t process_rss_bytes();

void write_timeline_csv(const std::vector<MemoryEvent>& events, std::ostream& out);
// Chrome trace JSON (Perfetto): a counter track of live bytes and one slice per phase.
void write_timeline_chrome_trace(const std::vector<MemoryEvent>& events, std::ostream& out);

}  // namespace sbp
