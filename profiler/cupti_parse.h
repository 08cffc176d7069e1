// CUPTI activity buffers -> CuptiRecords. CUDA builds only (it needs CUPTI's headers). The recorder's
// buffer-completed callback is the one production caller; tests hand it buffers laid out with CUPTI's own structs.
#pragma once

#include <cupti_activity.h>

#include <cstddef>
#include <cstdint>

#include "profiler/cupti_recorder.h"

namespace sbp {

// The kinds parse_activity_buffer converts, hence the kinds the recorder enables.
inline constexpr CUpti_ActivityKind kConvertedActivityKinds[] = {
    CUPTI_ACTIVITY_KIND_MEMORY2, CUPTI_ACTIVITY_KIND_MEMORY_POOL, CUPTI_ACTIVITY_KIND_MEMCPY,
    CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL};

// libcupti's cuptiActivityGetNextRecord, the walker: only it knows each kind's record size in the loaded CUPTI.
using CuptiNextRecordFn = decltype(&cuptiActivityGetNextRecord);

// Walks the first valid_size bytes of one completed activity buffer with `next` and appends to `recording`: the
// records of kConvertedActivityKinds, read as this toolkit's CUpti_ActivityMemory4, CUpti_ActivityMemoryPool3,
// CUpti_ActivityMemcpy6 and CUpti_ActivityKernel10, to .records in buffer order (unsorted); every other record,
// and a kernel or copy with start == end == 0 (CUPTI could not time it), to .unconverted_records. A walk that ends
// in an error other than CUPTI_ERROR_MAX_LIMIT_REACHED (the normal end) adds 1 to .unreadable_buffers.
// .dropped_records is the caller's: it comes from libcupti, not from the buffer.
void parse_activity_buffer(const std::uint8_t* buffer, std::size_t valid_size, CuptiNextRecordFn next,
                           CuptiRecording& recording);

}  // namespace sbp
