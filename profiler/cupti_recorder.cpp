#include "profiler/cupti_recorder.h"

#include <cuda_runtime_api.h>
#include <cupti.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <iterator>
#include <mutex>
#include <utility>

#include "profiler/cuda_memory.h"
#include "profiler/cupti_parse.h"

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
  CuptiNextRecordFn next_record = nullptr;
  decltype(&cuptiActivityGetNumDroppedRecords) dropped_records = nullptr;
};

// The record layouts parse_activity_buffer reads (CUpti_ActivityMemory4, ...) are this toolkit's; CUPTI keeps them
// within a major version (API version xxyyzz since CUDA 13, xx = major), so only a library of the same major is
// accepted.
constexpr unsigned kCuptiMajor = CUPTI_API_VERSION / 10000;

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
      !find_symbol(library, "cuptiActivityGetNextRecord", api.next_record, out.error) ||
      !find_symbol(library, "cuptiActivityGetNumDroppedRecords", api.dropped_records, out.error))
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
std::atomic<bool> g_running{false};
const CuptiApi* g_api = nullptr;  // set before the callbacks are registered
std::mutex g_recording_mutex;     // buffer_completed runs on CUPTI's worker thread
CuptiRecording g_recording;

// CUPTI hands out many records per buffer and asks for the next buffer only when one is full.
constexpr std::size_t kBufferBytes = std::size_t{8} << 20;
constexpr std::size_t kBufferAlignment = 8;  // CUPTI rejects buffers not aligned to 8 bytes

void CUPTIAPI buffer_requested(std::uint8_t** buffer, std::size_t* size, std::size_t* max_num_records) {
  *buffer = static_cast<std::uint8_t*>(std::aligned_alloc(kBufferAlignment, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;  // CUPTI drops the records it cannot store
  *max_num_records = 0;                // as many as fit
}

void CUPTIAPI buffer_completed(CUcontext context, std::uint32_t stream_id, std::uint8_t* buffer, std::size_t,
                               std::size_t valid_size) {
  // The count is reset by each call, so summing it over the buffers counts every record lost while recording.
  std::size_t dropped = 0;
  if (g_api->dropped_records(context, stream_id, &dropped) != CUPTI_SUCCESS) dropped = 0;
  {
    const std::lock_guard lock(g_recording_mutex);
    parse_activity_buffer(buffer, valid_size, g_api->next_record, g_recording);
    g_recording.dropped_records += dropped;
  }
  std::free(buffer);
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
  if (g_running.exchange(true)) return fail(reason, "another CuptiRecorder is running");
  {
    const std::lock_guard lock(g_recording_mutex);
    g_recording = {};  // leftovers a previous recorder's late buffers may have added
  }
  g_api = api;
  if (const CUptiResult r = api->register_callbacks(buffer_requested, buffer_completed); r != CUPTI_SUCCESS) {
    g_running = false;
    return fail(reason, "cuptiActivityRegisterCallbacks: " + result_text(*api, r));
  }
  const auto& kinds = kConvertedActivityKinds;
  for (std::size_t i = 0; i < std::size(kinds); ++i) {
    if (const CUptiResult r = api->enable(kinds[i]); r != CUPTI_SUCCESS) {
      for (std::size_t j = 0; j < i; ++j) api->disable(kinds[j]);
      g_running = false;
      return fail(reason, "cuptiActivityEnable(kind " + std::to_string(static_cast<int>(kinds[i])) +
                              "): " + result_text(*api, r));
    }
  }
  running_ = true;
  return true;
}

CuptiRecording CuptiRecorder::stop() {
  if (!running_) return {};
  running_ = false;
  // A flush delivers only completed records, and a kernel still running has no end time yet. An error returned here
  // belongs to the caller's earlier launches; it stays pending for their next CUDA call.
  cudaDeviceSynchronize();
  for (const CUpti_ActivityKind kind : kConvertedActivityKinds) g_api->disable(kind);
  g_api->flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  CuptiRecording recording;
  {
    const std::lock_guard lock(g_recording_mutex);
    std::swap(recording, g_recording);
  }
  g_running = false;
  std::stable_sort(recording.records.begin(), recording.records.end(),
                   [](const CuptiRecord& a, const CuptiRecord& b) { return a.start_ns < b.start_ns; });
  return recording;
}

}  // namespace sbp
