// The CLI's one exit-code contract (README: Exit codes). A command returns its verdict (0, 1, 3 where it has one);
// an exception ending it is mapped here, so that only bad input exits 2 and a bug never passes for a user's mistake.
#pragma once

#include <functional>

#include "experiments/interrupt.h"

namespace sbp {

enum ExitStatus : int {
  kExitOk = 0,
  kExitFailed = 1,          // a verdict failed (compare, verify --gate, conform), or a peer rank failed
  kExitInput = 2,           // bad input: a flag, a file, a spec or a combination (InputError, CLI11's rejections)
  kExitOutOfMemory = 3,     // out of memory (an oom record); conform: a case the implementation cannot express
  kExitInternal = 70,       // an internal error: a bug to report (sysexits' EX_SOFTWARE)
  kExitInterrupted = kInterruptedExit,  // Ctrl-C (SIGINT): stopped after a consistent point
};

// Runs `command` and returns its status; an exception it throws is printed on stderr as "streambp: error: ..." (input,
// status 2), "streambp: out of memory: ..." (3), "streambp: a peer rank failed: ..." (1) or "streambp: internal
// error: ... (please report ...)" (70).
int run_with_exit_status(const std::function<int()>& command);

}  // namespace sbp
