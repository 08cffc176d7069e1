// Ctrl-C during `train`: the first SIGINT lets the current step finish, the run writes a checkpoint and says how to
// resume; a second one ends the process at once (the default action). Data-parallel ranks all receive the signal
// from the terminal and agree after each step (training/communicator.h), so that they stop at the same step.
#pragma once

namespace sbp {

// Installs the SIGINT handler (once per process).
void watch_interrupts();
// Whether a SIGINT arrived since watch_interrupts().
bool interrupted();
// The exit status of a run stopped by SIGINT, as a shell reports a process killed by it.
constexpr int kInterruptedExit = 130;

}  // namespace sbp
