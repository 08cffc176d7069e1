// Device-level timeline from the CUPTI activity API: every cudaMalloc/cudaFree the caching allocator makes (not
// every tensor: those stay inside the cache, see cuda_memory.h), memory-pool changes and kernel executions.
// Implementations: cupti_recorder.cpp (CUDA builds; loads libcupti with dlopen only once a GPU is found, so the
// binary neither needs nor fails without it) and cupti_recorder_stub.cpp. The writers live in cupti_export.cpp.
//
// Never run this together with the torch profiler: CUPTI delivers activity buffers to one set of callbacks per
// process, and whichever of the two registers last silently takes all records from the other.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace sbp {

struct CuptiRecord {
  std::string kind;  // "memory", "memory_pool", "kernel"
  // memory: the memory kind ("device", "pinned", "managed", ...); memory_pool: the operation ("created",
  // "destroyed", "trimmed"); kernel: the demangled kernel name.
  std::string name;
  std::uint64_t start_ns = 0, end_ns = 0;  // CUPTI timestamps; start == end for memory and memory_pool
  // memory: signed change, +size on allocation and -size on release, so a running sum is the bytes held;
  // memory_pool: the size CUPTI reports for the operation, 0 when destroyed; kernel: 0.
  std::int64_t bytes = 0;
  std::int64_t address = 0;  // memory: the block; memory_pool: the pool; kernel: 0
  int device = 0;
};

// One recorder at a time per process (CUPTI's callbacks are process-wide).
class CuptiRecorder {
 public:
  CuptiRecorder() = default;
  CuptiRecorder(const CuptiRecorder&) = delete;
  CuptiRecorder& operator=(const CuptiRecorder&) = delete;
  ~CuptiRecorder();  // stops if still running, dropping the records

  // Returns false with a reason when there is no GPU, libcupti cannot be loaded, another recorder is running or
  // CUPTI refuses. Enables CUPTI_ACTIVITY_KIND_MEMORY2, _MEMORY_POOL and _CONCURRENT_KERNEL.
  bool start(std::string* reason = nullptr);

  // Synchronizes the current device (so every kernel launched before has its end time), flushes CUPTI and returns
  // the records sorted by start time. Empty if start() did not succeed.
  std::vector<CuptiRecord> stop();

 private:
  bool running_ = false;
};

// CSV with header kind,name,start_ns,end_ns,bytes,address,device; a name with a comma or quote is quoted.
void write_cupti_csv(const std::vector<CuptiRecord>& records, std::ostream& out);

// Chrome trace JSON (open in Perfetto), one process per device: kernels as complete events ("ph":"X"), memory as a
// counter ("ph":"C") of the running total per memory kind, memory pools as a counter of each pool's bytes.
// Timestamps are microseconds since the earliest record; its CUPTI time is in otherData.origin_ns.
void write_cupti_chrome_trace(const std::vector<CuptiRecord>& records, std::ostream& out);

}  // namespace sbp
