#include "profiler/cupti_parse.h"

#include <cxxabi.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <string>

namespace sbp {
namespace {

const char* memory_kind_name(CUpti_ActivityMemoryKind kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMORY_KIND_PAGEABLE: return "pageable";
    case CUPTI_ACTIVITY_MEMORY_KIND_PINNED: return "pinned";
    case CUPTI_ACTIVITY_MEMORY_KIND_DEVICE: return "device";
    case CUPTI_ACTIVITY_MEMORY_KIND_ARRAY: return "array";
    case CUPTI_ACTIVITY_MEMORY_KIND_MANAGED: return "managed";
    case CUPTI_ACTIVITY_MEMORY_KIND_DEVICE_STATIC: return "device_static";
    case CUPTI_ACTIVITY_MEMORY_KIND_MANAGED_STATIC: return "managed_static";
    default: return "unknown";
  }
}

const char* pool_operation_name(CUpti_ActivityMemoryPoolOperationType operation) {
  switch (operation) {
    case CUPTI_ACTIVITY_MEMORY_POOL_OPERATION_TYPE_CREATED: return "created";
    case CUPTI_ACTIVITY_MEMORY_POOL_OPERATION_TYPE_DESTROYED: return "destroyed";
    case CUPTI_ACTIVITY_MEMORY_POOL_OPERATION_TYPE_TRIMMED: return "trimmed";
    default: return "unknown";
  }
}

// H = host, D = device, A = CUDA array, P = peer device: the names nsys and the CUPTI samples print.
const char* memcpy_kind_name(CUpti_ActivityMemcpyKind kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOA: return "HtoA";
    case CUPTI_ACTIVITY_MEMCPY_KIND_ATOH: return "AtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_ATOA: return "AtoA";
    case CUPTI_ACTIVITY_MEMCPY_KIND_ATOD: return "AtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOA: return "DtoA";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH: return "HtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: return "PtoP";
    default: return "unknown";
  }
}

// Kernel names arrive mangled (`_ZN2at6native...`); the trace is read by people.
std::string demangle(const char* name) {
  if (!name) return "unknown";
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> demangled(abi::__cxa_demangle(name, nullptr, nullptr, &status),
                                                         &std::free);
  return status == 0 ? std::string(demangled.get()) : std::string(name);
}

// The record structs are this toolkit's latest; CUPTI keeps a kind's layout within a major version, and the
// recorder loads only a libcupti of the headers' major.
std::optional<CuptiRecord> convert(const CUpti_Activity& activity) {
  switch (activity.kind) {
    case CUPTI_ACTIVITY_KIND_MEMORY2: {
      const auto& m = reinterpret_cast<const CUpti_ActivityMemory4&>(activity);
      const auto bytes = static_cast<std::int64_t>(m.bytes);
      std::int64_t change = 0;
      if (m.memoryOperationType == CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_ALLOCATION) change = bytes;
      else if (m.memoryOperationType == CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_RELEASE) change = -bytes;
      else return std::nullopt;
      return CuptiRecord{CuptiKind::memory, memory_kind_name(m.memoryKind), m.timestamp, m.timestamp, change,
                         static_cast<std::int64_t>(m.address), static_cast<int>(m.deviceId)};
    }
    case CUPTI_ACTIVITY_KIND_MEMORY_POOL: {
      const auto& p = reinterpret_cast<const CUpti_ActivityMemoryPool3&>(activity);
      const bool destroyed = p.memoryPoolOperationType == CUPTI_ACTIVITY_MEMORY_POOL_OPERATION_TYPE_DESTROYED;
      return CuptiRecord{CuptiKind::memory_pool, pool_operation_name(p.memoryPoolOperationType), p.timestamp, p.timestamp,
                         destroyed ? 0 : static_cast<std::int64_t>(p.size), static_cast<std::int64_t>(p.address),
                         static_cast<int>(p.deviceId)};
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
      const auto& c = reinterpret_cast<const CUpti_ActivityMemcpy6&>(activity);
      if (c.start == 0 && c.end == 0) return std::nullopt;  // CUPTI could not time it
      return CuptiRecord{CuptiKind::memcpy, memcpy_kind_name(static_cast<CUpti_ActivityMemcpyKind>(c.copyKind)), c.start,
                         c.end, static_cast<std::int64_t>(c.bytes), 0, static_cast<int>(c.deviceId)};
    }
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
      const auto& k = reinterpret_cast<const CUpti_ActivityKernel10&>(activity);
      if (k.start == 0 && k.end == 0) return std::nullopt;  // CUPTI could not time it (no device memory left)
      return CuptiRecord{CuptiKind::kernel, demangle(k.name), k.start, k.end, 0, 0, static_cast<int>(k.deviceId)};
    }
    default: return std::nullopt;
  }
}

}  // namespace

void parse_activity_buffer(const std::uint8_t* buffer, std::size_t valid_size, CuptiNextRecordFn next,
                           CuptiRecording& recording) {
  // CUPTI's walker takes a non-const buffer but only reads it.
  auto* bytes = const_cast<std::uint8_t*>(buffer);
  CUpti_Activity* activity = nullptr;  // null: start at the first record
  CUptiResult result;
  while ((result = next(bytes, valid_size, &activity)) == CUPTI_SUCCESS) {
    if (auto record = convert(*activity)) recording.records.push_back(std::move(*record));
    else ++recording.unconverted_records;
  }
  if (result != CUPTI_ERROR_MAX_LIMIT_REACHED) ++recording.unreadable_buffers;
}

}  // namespace sbp
