// The narrow-dtype GEMM paths measured once per machine and reused by every later process of it (issue #49).
//
// A path changes the bits of every product, so two processes of one machine must take the same one (a resumed run,
// the ranks of a data-parallel group); a timing per process flipped under load. A fixed rule (native only with AMX)
// was fitted to one CPU and cost another 1.8x. So the native and widened speed of each layout is measured once,
// under an exclusive lock on a file of the cache folder, and stored there as JSON keyed by what decides the kernels:
// the CPU model and its relevant flags, torch's version, oneDNN's cap, the dtype and the thread count. A second
// process started at the same time waits on the lock and reads what the first stored. Nothing here is on a hot path:
// gemm.cpp asks once per dtype and process.
#pragma once

#include <array>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>

#include <c10/core/ScalarType.h>

#include "core/model/gemm.h"

namespace sbp {

// What decides which kernels run a narrow product on a CPU.
struct GemmMachineKey {
  std::string cpu_model;       // /proc/cpuinfo's "model name"
  std::string cpu_flags;       // only those that pick oneDNN's kernels, in a fixed order ("avx2 avx512f avx512_bf16")
  std::string torch_version;   // "2.14.1"
  std::string onednn_max_isa;  // ONEDNN_MAX_CPU_ISA, "" when unset
  std::string dtype;           // "bf16", "fp16"
  int threads = 0;             // intra-op threads
  bool operator==(const GemmMachineKey&) const = default;
  std::string describe() const;  // one line, for messages
  std::string file_name() const;  // "gemm-path-<16 hex digits of the key's hash>.json"
};
// The running process's key for `dtype` (its CPU, torch, environment and current thread count).
GemmMachineKey running_gemm_key(c10::ScalarType dtype);

// One layout's fastest time on each path (the minimum over repeats, seconds).
struct LayoutSeconds {
  double native = 0, widened = 0;
};
struct GemmMeasurement {
  std::array<LayoutSeconds, 3> layouts;  // nt, nn, tn
  int attempts = 1;                      // more than one: the machine was loaded and the probe measured again
  std::string shapes;                    // the products measured, in words
};
// Native only where it is faster by more than this fraction: a layout within the margin keeps the widened path, so
// that noise between near-equal paths cannot decide.
inline constexpr double kNativeMargin = 0.10;
GemmPaths paths_from(const GemmMeasurement& m);

// The real probe (gemm_probe.cpp): each layout's products of a fixed representative shape on both paths in `dtype`,
// interleaved, the minimum of several repeats, measured again (up to 3 attempts) while the repeats spread widely.
GemmMeasurement time_gemm_paths(c10::ScalarType dtype);

// The folder of the harness's caches: $STREAMBP_CACHE, else $HOME/.cache/streambp (the Makefile's CACHE).
std::filesystem::path streambp_cache_folder();

enum class GemmStoreMode {
  reuse,      // the stored choice, else measure (under the lock) and store it
  remeasure,  // measure (under the lock) and replace what is stored
  read_only,  // the stored choice or nothing; never measure (tests, CI)
};
struct StoredGemmPaths {
  GemmPaths paths;
  GemmMeasurement measurement;
  std::string date;              // when it was measured, UTC ISO 8601
  std::filesystem::path file;    // where it is stored
  bool measured_now = false;     // this call measured it
  // "measured 2026-11-28T01:46:04Z, nt native/widened 0.44, nn ..., tn ...; stored in <file>"
  std::string reason() const;
};
// The stored choice for `key` in `folder`, measured with `probe` when the mode asks. Nothing (and a warning on
// stderr) where the folder cannot be created or locked or the file cannot be written: the caller then takes a
// choice every process makes alike. A corrupt file or one of another key is ignored with a warning and replaced.
std::optional<StoredGemmPaths> stored_gemm_paths(const std::filesystem::path& folder, const GemmMachineKey& key,
                                                 const std::function<GemmMeasurement()>& probe, GemmStoreMode mode);

}  // namespace sbp
