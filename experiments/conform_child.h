// conform's implementation runs (issue #21): a command on a case directory as a child process in its own process
// group, timed, metered and killed after a timeout, and what its output says when it fails.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include "verify/conformance.h"

namespace sbp {

// `s` as one single-quoted /bin/sh word.
std::string quoted(const std::string& s);

struct ChildRun {
  std::string outcome;  // "" when it exited 0; else how it ended
  int exit_status = 0;  // -1 when killed
  double wall_seconds = 0, cpu_seconds = 0;
  std::int64_t peak_rss_bytes = 0;  // the largest process's, sampled every 20 ms
  bool interrupted = false;  // killed because conform got a Ctrl-C
  ImplementationProvenance provenance;  // what result.json says it ran with
};

// `command case_dir` through /bin/sh in its own process group, output to case_dir/impl.log; after `timeout` seconds
// SIGTERM to the group and SIGKILL a grace later (a distributed adapter names the ranks that had not finished).
ChildRun run_child(const std::string& command, const std::filesystem::path& case_dir, double timeout);

// The last non-empty line of a file that is not a progress bar, cut at 200 characters ("" when none).
std::string last_line(const std::filesystem::path& file);

// For the first command that failed to run: the command line, the end of its output (impl.log), which python ran it,
// and `harness_python` as the remedy when that one has no torch.
std::string failed_run_note(const std::string& who, const std::string& command, const std::filesystem::path& dir,
                            const std::string& outcome, const std::string& harness_python);

}  // namespace sbp
