#include "profiler/cupti_recorder.h"

#include <cuda_runtime_api.h>
#include <cupti.h>
#include <cxxabi.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>

#include "profiler/cuda_memory.h"

namespace sbp {
namespace {

// libcupti's entry points, found with dlsym; the types are those of cupti.h's prototypes.
struct CuptiApi {
  decltype(&cuptiGetVersion) get_version = nullptr;
  decltype(&cuptiGetResultString) result_string = nullptr;
  decltype(&cuptiActivityRegisterCallbacks) register_callbacks = nullptr;
  decltype(&cuptiActivityEnable) enable = nullptr;
  decltype(&cuptiActivityDisable) disable = nullptr;
  decltype(&cuptiActivityFlushAll) flush_all = nullptr;
  decltype(&cuptiActivityGetNextRecord) next_record = nullptr;
};

// The record layouts read below (CUpti_ActivityMemory4, ...) are this toolkit's; CUPTI keeps them within a major
// version (API version xxyyzz since CUDA 13, xx = major), so only a library of the same major is accepted.
constexpr unsigned kCuptiMajor = CUPTI_API_VERSION / 10000;

constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_MEMORY2, CUPTI_ACTIVITY_KIND_MEMORY_POOL,
                                         CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL};

struct LoadedCupti {
  CuptiApi api;
  std::string error;  // empty when loaded
};

template <typename Fn>
bool find_symbol(void* library, const char* name, Fn& fn, std::string& error) {
  fn = reinterpret_cast<Fn>(dlsym(library, name));
  if (!fn) error = std::string("libcupti has no ") + name;
  return fn != nullptr;
}

LoadedCupti load_cupti_once() {
  LoadedCupti out;
  // The soname first: libtorch_cpu (kineto) NEEDs libcupti, so this returns the copy already in the process and
  // there is one CUPTI, not two fighting over the driver's callbacks. Then the toolkit's copy, if CMake named it.
  const std::string soname = "libcupti.so." + std::to_string(kCuptiMajor);
  void* library = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
#ifdef STREAMBP_CUPTI_LIBRARY
  if (!library) library = dlopen(STREAMBP_CUPTI_LIBRARY, RTLD_NOW | RTLD_LOCAL);
#endif
  if (!library) {
    const char* error = dlerror();
    out.error = "cannot load " + soname + ": " + (error ? error : "not found");
    return out;
  }
  // Never dlclose'd: CUPTI keeps worker threads and our callbacks until the process exits.
  CuptiApi& api = out.api;
  if (!find_symbol(library, "cuptiGetVersion", api.get_version, out.error) ||
      !find_symbol(library, "cuptiGetResultString", api.result_string, out.error) ||
      !find_symbol(library, "cuptiActivityRegisterCallbacks", api.register_callbacks, out.error) ||
      !find_symbol(library, "cuptiActivityEnable", api.enable, out.error) ||
      !find_symbol(library, "cuptiActivityDisable", api.disable, out.error) ||
      !find_symbol(library, "cuptiActivityFlushAll", api.flush_all, out.error) ||
      !find_symbol(library, "cuptiActivityGetNextRecord", api.next_record, out.error))
    return out;
  std::uint32_t version = 0;
  if (api.get_version(&version) != CUPTI_SUCCESS || version / 10000 != kCuptiMajor)
    out.error = "libcupti API version " + std::to_string(version) + " does not match the headers' " +
                std::to_string(CUPTI_API_VERSION);
  return out;
}

// Null with *error set when libcupti is unusable.
const CuptiApi* load_cupti(std::string* error) {
  static const LoadedCupti loaded = load_cupti_once();
  if (!loaded.error.empty()) {
    *error = loaded.error;
    return nullptr;
  }
  return &loaded.api;
}

std::string result_text(const CuptiApi& api, CUptiResult result) {
  const char* text = nullptr;
  if (api.result_string(result, &text) == CUPTI_SUCCESS && text) return text;
  return "CUPTI error " + std::to_string(static_cast<int>(result));
}

// CUPTI's buffer callbacks carry no user pointer, so the state of the one running recorder is global.
std::atomic<bool> g_recording{false};
const CuptiApi* g_api = nullptr;  // set before the callbacks are registered
std::mutex g_records_mutex;       // buffer_completed runs on CUPTI's worker thread
std::vector<CuptiRecord> g_records;

// CUPTI hands out many records per buffer and asks for the next buffer only when one is full.
constexpr std::size_t kBufferBytes = std::size_t{8} << 20;
constexpr std::size_t kBufferAlignment = 8;  // CUPTI rejects buffers not aligned to 8 bytes

void CUPTIAPI buffer_requested(std::uint8_t** buffer, std::size_t* size, std::size_t* max_num_records) {
  *buffer = static_cast<std::uint8_t*>(std::aligned_alloc(kBufferAlignment, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;  // CUPTI drops the records it cannot store
  *max_num_records = 0;                // as many as fit
}

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

// Kernel names arrive mangled (`_ZN2at6native...`); the trace is read by people.
std::string demangle(const char* name) {
  if (!name) return "unknown";
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> demangled(abi::__cxa_demangle(name, nullptr, nullptr, &status),
                                                         &std::free);
  return status == 0 ? std::string(demangled.get()) : std::string(name);
}

std::optional<CuptiRecord> convert(const CUpti_Activity& activity) {
  switch (activity.kind) {
    case CUPTI_ACTIVITY_KIND_MEMORY2: {
      const auto& m = reinterpret_cast<const CUpti_ActivityMemory4&>(activity);
      const auto bytes = static_cast<std::int64_t>(m.bytes);
      std::int64_t change = 0;
      if (m.memoryOperationType == CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_ALLOCATION) change = bytes;
      else if (m.memoryOperationType == CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_RELEASE) change = -bytes;
      else return std::nullopt;
      return CuptiRecord{"memory", memory_kind_name(m.memoryKind), m.timestamp, m.timestamp, change,
                         static_cast<std::int64_t>(m.address), static_cast<int>(m.deviceId)};
    }
    case CUPTI_ACTIVITY_KIND_MEMORY_POOL: {
      const auto& p = reinterpret_cast<const CUpti_ActivityMemoryPool3&>(activity);
      const bool destroyed = p.memoryPoolOperationType == CUPTI_ACTIVITY_MEMORY_POOL_OPERATION_TYPE_DESTROYED;
      return CuptiRecord{"memory_pool", pool_operation_name(p.memoryPoolOperationType), p.timestamp, p.timestamp,
                         destroyed ? 0 : static_cast<std::int64_t>(p.size), static_cast<std::int64_t>(p.address),
                         static_cast<int>(p.deviceId)};
    }
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
      const auto& k = reinterpret_cast<const CUpti_ActivityKernel10&>(activity);
      return CuptiRecord{"kernel", demangle(k.name), k.start, k.end, 0, 0, static_cast<int>(k.deviceId)};
    }
    default: return std::nullopt;
  }
}

void CUPTIAPI buffer_completed(CUcontext, std::uint32_t, std::uint8_t* buffer, std::size_t, std::size_t valid_size) {
  std::vector<CuptiRecord> parsed;
  CUpti_Activity* activity = nullptr;
  // Ends with CUPTI_ERROR_MAX_LIMIT_REACHED after the last record.
  while (g_api->next_record(buffer, valid_size, &activity) == CUPTI_SUCCESS)
    if (auto record = convert(*activity)) parsed.push_back(std::move(*record));
  std::free(buffer);
  const std::lock_guard lock(g_records_mutex);
  g_records.insert(g_records.end(), std::make_move_iterator(parsed.begin()), std::make_move_iterator(parsed.end()));
}

bool fail(std::string* reason, std::string why) {
  if (reason) *reason = std::move(why);
  return false;
}

}  // namespace

CuptiRecorder::~CuptiRecorder() {
  if (running_) stop();
}

bool CuptiRecorder::start(std::string* reason) {
  if (running_) return fail(reason, "this CuptiRecorder is already running");
  std::string why;
  if (!cuda_device_available(&why)) return fail(reason, why);
  const CuptiApi* api = load_cupti(&why);
  if (!api) return fail(reason, why);
  if (g_recording.exchange(true)) return fail(reason, "another CuptiRecorder is running");
  {
    const std::lock_guard lock(g_records_mutex);
    g_records.clear();  // leftovers a previous recorder's late buffers may have added
  }
  g_api = api;
  if (const CUptiResult r = api->register_callbacks(buffer_requested, buffer_completed); r != CUPTI_SUCCESS) {
    g_recording = false;
    return fail(reason, "cuptiActivityRegisterCallbacks: " + result_text(*api, r));
  }
  for (std::size_t i = 0; i < std::size(kKinds); ++i) {
    if (const CUptiResult r = api->enable(kKinds[i]); r != CUPTI_SUCCESS) {
      for (std::size_t j = 0; j < i; ++j) api->disable(kKinds[j]);
      g_recording = false;
      return fail(reason, "cuptiActivityEnable(kind " + std::to_string(static_cast<int>(kKinds[i])) +
                              "): " + result_text(*api, r));
    }
  }
  running_ = true;
  return true;
}

std::vector<CuptiRecord> CuptiRecorder::stop() {
  if (!running_) return {};
  running_ = false;
  // A flush delivers only completed records, and a kernel still running has no end time yet. An error returned here
  // belongs to the caller's earlier launches; it stays pending for their next CUDA call.
  cudaDeviceSynchronize();
  for (const CUpti_ActivityKind kind : kKinds) g_api->disable(kind);
  g_api->flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  std::vector<CuptiRecord> records;
  {
    const std::lock_guard lock(g_records_mutex);
    records.swap(g_records);
  }
  g_recording = false;
  std::stable_sort(records.begin(), records.end(),
                   [](const CuptiRecord& a, const CuptiRecord& b) { return a.start_ns < b.start_ns; });
  return records;
}

}  // namespace sbp
