// CUDA memory meter: the CPU meter's interface (cpu_meter.h) over torch's CUDA caching allocator, one per device
// (ARCHITECTURE.md §7; the caching allocator's device statistics and CUPTI's activity records). No CUDA or torch include here, so CPU-only code can hold one. Implementations:
// cuda_meter.cpp (CUDA builds) and cuda_meter_stub.cpp; the parts that need no GPU are in caching_allocator.h.
//
// Without a GPU (or for a device that does not exist) nothing throws: available() is false, reason() says why, every
// number is 0, the budget stays 0 and start_timeline() refuses. With one, a failing CUDA call throws c10::Error.
//
// What is measured. "Allocated" bytes are the caching allocator's blocks held by live tensors (each request rounded
// up to a multiple of 512 B; a cached block too little larger to be split is counted whole); "reserved" bytes are
// what it got from cudaMalloc (>= allocated: its cache). Neither counts the CUDA context or memory not taken through
// torch's allocator (NCCL buffers, other processes). Peaks are read from the allocator's own statistics
// (getDeviceStats, AGGREGATE of the small and large pools), so they are exact, not sampled.
//
// Per-phase peaks are exact too: at every phase entry and exit the meter reads the allocator's peak since the last
// boundary, folds it into the peaks of the phases open during that window and into the overall peak, and starts a
// new window with resetPeakStats. Consequences: while a meter listens to phases, torch's own peak statistics
// (cuda_memory_stats, torch.cuda.max_memory_allocated) only cover the time since the last boundary, so read peaks
// from the meter; and calling cuda_reset_peak_stats meanwhile loses the window it resets. An allocation and its free
// on another host thread between the read and the reset are also lost (the BP methods issue work from one thread).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/methods/phase.h"
#include "profiler/cpu_meter.h"

namespace sbp {

// What a CUDA timeline saw besides the events of live tensor bytes (see AllocatorTraceAdapter for each action).
struct AllocatorTraceCounts {
  std::int64_t segment_allocs = 0;        // cudaMalloc (segment_alloc) and cuMemMap (segment_map) calls
  std::int64_t segment_frees = 0;         // cudaFree (segment_free) and cuMemUnmap (segment_unmap) calls
  std::int64_t reserved_delta_bytes = 0;  // the reserved bytes those calls added (negative: returned to CUDA)
  std::int64_t ooms = 0;                  // OutOfMemoryErrors the allocator raised
  std::int64_t oom_requested_bytes = 0;   // the rounded request of the last one
};

class CudaMemoryMeter final : public PhaseListener {
 public:
  // The meter of `device`, made on first use and kept for the process (the allocator's trace callback it attaches
  // cannot be detached; it is attached once, for every device, and routes each entry to its device's meter).
  // Making it starts its peaks from the current values, resetting torch's peak statistics of the device.
  // Not registered as the phase listener: call set_phase_listener(&meter) to get per-phase peaks and phase names
  // in the timeline (there is one listener at a time, so this replaces the CPU meter's).
  static CudaMemoryMeter& for_device(int device = 0);

  bool available() const;
  const std::string& reason() const;  // why not available; "" when it is
  int device() const;

  std::int64_t current_bytes() const;  // allocated bytes now
  // Highest allocated bytes since the last reset_peak() (or since the meter was made).
  std::int64_t peak_bytes() const;
  std::int64_t reserved_bytes() const;  // reserved bytes now
  std::int64_t reserved_peak_bytes() const;
  // Largest single request (a tensor's unrounded size) since the last reset_peak(), from the allocator's trace
  // callback; -1 when it cannot be attached (the cudaMallocAsync backend, PYTORCH_CUDA_ALLOC_CONF=backend:...).
  std::int64_t largest_allocation_bytes() const;
  // Peaks := current values (also torch's own, via resetPeakStats); clears the phase peaks, the open phases and the
  // largest allocation.
  void reset_peak();

  // Limits the bytes the caching allocator may RESERVE on this device to `bytes` (0: lifts the limit, restoring the
  // fraction in force before the first budget, e.g. PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction:...).
  // Enforced by torch itself through setMemoryFraction(memory_fraction_for_budget(bytes, totalGlobalMem)): when a
  // request finds no cached block and a new segment would take reserved bytes above the limit, the allocator first
  // frees its unused cached segments and retries, and only then throws c10::OutOfMemoryError ("CUDA out of memory
  // ... N allowed"), as a full GPU of `bytes` would. So the budget bounds reserved memory, not allocated: segments
  // come in 2 MiB (small requests), 20 MiB (1 to 10 MiB) or the request rounded up to 2 MiB, and fragmentation
  // counts. Only this process's allocator counts toward it: not the CUDA context, other processes or other
  // allocators, which is why the fraction is budget / total and nothing is added for them (a GPU shared with another
  // process can still run out first, for real). Setting a budget below the bytes reserved now frees nothing until the
  // next segment is needed. No-op when unavailable (budget_bytes() stays 0).
  void set_budget_bytes(std::int64_t bytes);
  std::int64_t budget_bytes() const;

  // Peak allocated bytes of each phase over all its entries (an open phase includes the window so far), in order of
  // first entry.
  std::vector<PhasePeak> phase_peaks() const;

  // Records every allocation and completed free of this device from now on, as MemoryEvents like the CPU meter's:
  // seconds since the start (from the trace entries' own clock), current_bytes = requested bytes live (so at most
  // current_bytes(), which counts rounded blocks), the innermost phase, the allocation's number and its +/- size;
  // phase boundaries are events with block 0. Returns false, with the reason if asked, when unavailable or the trace
  // callback could not be attached; a timeline already running restarts.
  bool start_timeline(std::string* reason = nullptr);
  std::size_t timeline_size() const;  // events recorded so far
  std::vector<MemoryEvent> stop_timeline();  // empty if none was started
  AllocatorTraceCounts timeline_counts() const;  // of the running timeline, or of the last one stopped

  void enter_phase(const std::string& name) override;
  void leave_phase(const std::string& name) override;

  CudaMemoryMeter(const CudaMemoryMeter&) = delete;
  CudaMemoryMeter& operator=(const CudaMemoryMeter&) = delete;
  ~CudaMemoryMeter() override;

  struct State;  // per build: cuda_meter.cpp or cuda_meter_stub.cpp

 private:
  explicit CudaMemoryMeter(int device);
  std::unique_ptr<State> state_;
};

}  // namespace sbp
