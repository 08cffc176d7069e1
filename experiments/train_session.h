// One rank's `streambp train` (cmd_train.cpp checks the flags and launches the ranks first): a session over a
// Trainer (core/training/trainer.h) in three steps: resume (--resume's checkpoint, its trajectory checked), the loop of
// steps (a progress line, a metrics row and the checkpoints of each, Ctrl-C after any) and the finish (the final
// outputs and the --json record).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/objectives/batch.h"
#include "experiments/commands.h"
#include "experiments/launch.h"

namespace sbp {

// What the flags decide before any rank starts (cmd_train.cpp), the same on every rank.
struct TrainPlan {
  std::string checkpoint_dir;  // --checkpoint-dir, else --resume's folder ("": no checkpoints)
  std::int64_t taken = 0;      // the step --resume's latest complete checkpoint reached (0: none)
  bool finished = false;       // resumed at --steps or past it: no step, only the outputs the run has not written
  bool keep_json = false, keep_model = false, keep_adapter = false;  // a finished run's outputs that exist: kept
  MicroBatchRows micro_rows;   // --micro-batches (empty: --grad-accum's equal ones)
  std::optional<RankEnv> env;  // this process's rank (launch.h; none: one process, or the launcher of --nproc)
};

// --metrics FILE's JSON sidecar: FILE with the extension .json ("" without --metrics).
std::string metrics_sidecar(const std::string& metrics);

// This rank's run: 0, kExitOutOfMemory (refused before its first step) or kInterruptedExit (stopped by Ctrl-C).
int run_train_session(const TrainArgs& args, const TrainPlan& plan, const std::string& command_line);

}  // namespace sbp
