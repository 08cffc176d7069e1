// Where a result came from (ARCHITECTURE.md §9): enough to regenerate the row, recorded beside every result.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace sbp {

struct Provenance {
  std::string commit;         // git HEAD of the source tree, "+dirty" when it has uncommitted changes
  std::string date_utc;       // ISO 8601
  std::string machine;        // hostname, CPU model, cores, the instruction sets its kernels use; the GPU if any
  int threads = 0;            // intra-op threads used
  std::string torch_version;
  std::string command;        // the argv that reproduces the run
};

// `device`: describe_device() of the run's device ("cpu" or empty: nothing added to `machine`).
Provenance collect_provenance(const std::string& command, const std::string& device = "cpu");
nlohmann::json to_json(const Provenance& p);
// A file of the harness's own checkout (the sources this binary was built from): "results/grid" there. The data a
// command reads by default is found here, wherever it is run from.
std::string harness_path(const std::string& relative);
std::string shell_quote(const std::string& word);  // as a POSIX shell reads it back
std::string shell_quote_argv(int argc, char** argv);

}  // namespace sbp
