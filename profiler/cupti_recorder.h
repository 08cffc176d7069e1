// Device-level timeline from the CUPTI activity API: every cudaMalloc/cudaFree the caching allocator makes (not
// every tensor: those stay inside the cache, see cuda_memory.h), memory-pool changes, memory copies and kernel
// executions. Implementations: cupti_recorder.cpp (CUDA builds; loads libcupti with dlopen only once a GPU is found,
// so the binary neither needs nor fails without it; its buffer walk is cupti_parse.h) and cupti_recorder_stub.cpp.
// The timeline merge is in cupti_timeline.cpp and the writers in cupti_export.cpp; both need no CUDA.
//
// A `--profile cupti` run writes the same files as the CPU meter's timeline, plus the raw records:
//   CuptiRecorder recorder;  recorder.start(&reason) ... run ...  const CuptiRecording r = recorder.stop();
//   write_timeline_csv(cupti_memory_timeline(r.records, device).events, csv);  // cpu_meter.h's CSV
//   write_cupti_chrome_trace(r, trace);  // memory counters + kernel and memcpy slices, losses in otherData
//   write_cupti_csv(r, records_csv);     // every record, losses on the last line
//
// Never run this together with the torch profiler: CUPTI delivers activity buffers to one set of callbacks per
// process, and whichever of the two registers last silently takes all records from the other.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "profiler/cpu_meter.h"

namespace sbp {

// What a record is; its name in the CSV and the trace's categories is cupti_kind_name's.
enum class CuptiKind { memory, memory_pool, memcpy, kernel };
const char* cupti_kind_name(CuptiKind kind);  // "memory", "memory_pool", "memcpy", "kernel"

struct CuptiRecord {
  CuptiKind kind = CuptiKind::memory;
  // memory: the memory kind ("device", "pinned", "managed", ...); memory_pool: the operation ("created",
  // "destroyed", "trimmed"); memcpy: the direction ("HtoD", "DtoH", "DtoD", "HtoH", "PtoP", ...); kernel: the
  // demangled kernel name.
  std::string name;
  // CUPTI timestamps; start == end for memory and memory_pool, the execution interval for memcpy and kernel.
  std::uint64_t start_ns = 0, end_ns = 0;
  // memory: signed change, +size on allocation and -size on release, so a running sum is the bytes held;
  // memory_pool: the size CUPTI reports for the operation, 0 when destroyed; memcpy: the bytes copied; kernel: 0.
  std::int64_t bytes = 0;
  std::int64_t address = 0;  // memory: the block; memory_pool: the pool; memcpy and kernel: 0
  int device = 0;
};

// What a recording delivered and what it lost. A memory curve of a recording that lost records is off by the lost
// allocations, so every writer states the three counts.
struct CuptiRecording {
  std::vector<CuptiRecord> records;  // sorted by start_ns
  // Records CUPTI had no buffer space for, summed from cuptiActivityGetNumDroppedRecords at every buffer.
  std::uint64_t dropped_records = 0;
  // Records delivered but not converted: a kind not listed above (a later CUPTI or another client may enable more),
  // a memory record that is neither an allocation nor a release, a kernel or memcpy CUPTI could not time (0, 0).
  std::uint64_t unconverted_records = 0;
  // Buffers whose walk stopped at a record libcupti rejected (incomplete or invalid); the rest of each is lost.
  std::uint64_t unreadable_buffers = 0;
};

// "dropped_records=D unconverted_records=U unreadable_buffers=B": the CUPTI CSV's last line, for a log line too.
std::string cupti_losses(const CuptiRecording& recording);

// One recorder at a time per process (CUPTI's callbacks are process-wide).
class CuptiRecorder {
 public:
  CuptiRecorder() = default;
  CuptiRecorder(const CuptiRecorder&) = delete;
  CuptiRecorder& operator=(const CuptiRecorder&) = delete;
  ~CuptiRecorder();  // stops if still running, dropping the records

  // Returns false with a reason when there is no GPU, libcupti cannot be loaded, another recorder is running or
  // CUPTI refuses. Enables CUPTI_ACTIVITY_KIND_MEMORY2, _MEMORY_POOL, _MEMCPY and _CONCURRENT_KERNEL.
  bool start(std::string* reason = nullptr);

  // Synchronizes the current device (so every kernel launched before has its end time), flushes CUPTI and returns
  // the records sorted by start time with the loss counts. Empty, counts 0, if start() did not succeed.
  CuptiRecording stop();

 private:
  bool running_ = false;
};

// The memory records of one device and memory kind as a CPU-meter timeline (cpu_meter.h), so that a CUPTI run is
// written, plotted and categorized like a CPU run.
struct CuptiTimeline {
  // The first event (block 0, delta 0) marks the origin with bytes_before; then one event per memory record, in
  // time order: block = the address, delta_bytes = the record's signed bytes, current_bytes = bytes_before plus the
  // running sum (for "device" memory: what cudaMalloc holds, the reserved-like curve, not the allocated one),
  // seconds since origin_ns, phase "" (CUPTI sees no phases). Empty when there are no records at all.
  std::vector<MemoryEvent> events;
  // CUPTI time of seconds == 0: the earliest record of any kind and device, so that the timelines of all devices
  // and kinds and the kernel slices of write_cupti_chrome_trace share one clock.
  std::uint64_t origin_ns = 0;
  // Blocks allocated before the recording started and released during it: their bytes were held at the origin, so
  // the curve starts at bytes_before and never goes below 0. Blocks allocated before and never released are not
  // seen by CUPTI and not counted.
  std::int64_t bytes_before = 0;
  std::uint64_t blocks_before = 0;
};

// records: a CuptiRecording's (any order; records of other kinds only set the origin).
CuptiTimeline cupti_memory_timeline(const std::vector<CuptiRecord>& records, int device,
                                    const std::string& memory_kind = "device");

// The recording's memory copies in `direction` ("HtoD": an offload tier's fetches) beside its kernels: how many there
// were and how many ran, for some time, while a kernel of the same device ran (a copy that overlaps compute; one that
// waits for the kernels before it and holds back the ones after does not). Touching intervals do not overlap.
struct CopyOverlap {
  std::int64_t copies = 0, overlapping = 0;
};
CopyOverlap copy_overlap(const std::vector<CuptiRecord>& records, const std::string& direction);

// CSV with header kind,name,start_ns,end_ns,bytes,address,device; a name with a comma or quote is quoted. The last
// line is "# " + cupti_losses(recording) (pandas: read_csv(..., comment="#")).
void write_cupti_csv(const CuptiRecording& recording, std::ostream& out);

// Chrome trace JSON (open in Perfetto), one process per device: for each memory kind seen on it, the
// cupti_memory_timeline as a counter "<kind> memory" (args.bytes; the same counter events as the CPU meter's
// trace); kernels (thread 2) and memory copies (thread 3, args.bytes) as complete events ("ph":"X"); each memory
// pool's size as a counter. Timestamps are microseconds since the earliest record; otherData holds its CUPTI time
// (origin_ns) and dropped_records, unconverted_records and unreadable_buffers.
void write_cupti_chrome_trace(const CuptiRecording& recording, std::ostream& out);

}  // namespace sbp
