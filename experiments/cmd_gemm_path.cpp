// streambp gemm-path: this machine's stored bf16 GEMM paths (core/model/gemm_store.h), measured when none is stored
// or when --remeasure asks.
#include <cstdlib>
#include <string>

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "core/model/gemm.h"
#include "core/model/gemm_store.h"
#include "experiments/commands.h"

namespace sbp {

void add_gemm_path_options(CLI::App& app, GemmPathArgs& args) {
  app.add_flag("--remeasure", args.remeasure, "measure again and replace the stored choice (on a quiet machine)");
  app.add_option("--threads", args.threads, "intra-op threads, part of the key (default: torch's)")
      ->check(CLI::NonNegativeNumber);
}

int gemm_path_command(const GemmPathArgs& args, const std::string&) {
  if (args.threads > 0) at::set_num_threads(args.threads);
  const auto dtype = at::kBFloat16;
  const auto key = running_gemm_key(dtype);
  fmt::print("machine   {}\n", key.describe());
  const std::string pinned = std::getenv("STREAMBP_NARROW_GEMM") ? std::getenv("STREAMBP_NARROW_GEMM") : "";
  if (!pinned.empty())
    fmt::print("pinned    STREAMBP_NARROW_GEMM={} pins every process of this environment; the stored choice below "
               "is what the machine takes without it\n", pinned);
  if (!native_narrow_kernels(key.cpu_flags, key.onednn_max_isa, dtype)) {
    const auto [machine, why] = machine_gemm_paths(dtype);
    fmt::print("bf16      {} ({}; nothing to measure)\n", machine.describe(), why);
    return 0;
  }
  const auto folder = streambp_cache_folder();
  // STREAMBP_GEMM_PROBE=off never measures, here as in every process (the tests' setting); --remeasure asks to.
  const char* probe = std::getenv("STREAMBP_GEMM_PROBE");
  const auto mode = args.remeasure                               ? GemmStoreMode::remeasure
                    : probe && std::string(probe) == "off" ? GemmStoreMode::read_only
                                                                 : GemmStoreMode::reuse;
  const auto stored = stored_gemm_paths(folder, key, [] { return time_gemm_paths(at::kBFloat16); }, mode);
  if (!stored && mode == GemmStoreMode::read_only) {
    const auto [machine, why] = machine_gemm_paths(dtype);
    fmt::print("bf16      {} ({})\n", machine.describe(), why);
    return 0;
  }
  if (!stored) {
    fmt::print(stderr, "gemm-path: error: nothing could be stored in {} (set STREAMBP_CACHE to a writable folder)\n",
               folder.string());
    return 1;
  }
  fmt::print("probe     {}; {} attempt(s)\n", stored->measurement.shapes, stored->measurement.attempts);
  for (std::size_t i = 0; i < 3; ++i) {
    const auto& s = stored->measurement.layouts[i];
    fmt::print("layout    {}  native {:.4f} s  widened {:.4f} s\n", i == 0 ? "nt" : i == 1 ? "nn" : "tn", s.native,
               s.widened);
  }
  fmt::print("bf16      {} ({})\n", stored->paths.describe(), stored->reason());
  return 0;
}

}  // namespace sbp
