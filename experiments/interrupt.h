// Ctrl-C during `train` or `conform`: the first SIGINT lets the command stop cleanly (`train` finishes the current
// step, writes a checkpoint and says how to resume; `conform` stops the implementation and removes its temporary
// folder); a second one ends the process at once (the default action). Data-parallel ranks all receive the signal
// from the terminal and agree after each step (training/communicator.h), so that they stop at the same step.
#pragma once

namespace sbp {

// Installs the SIGINT handler (once per process); the first SIGINT prints `note` (a string literal: what the command
// does now) on stderr.
void watch_interrupts(const char* note);
// Whether a SIGINT arrived since watch_interrupts().
bool interrupted();
// The exit status of a run stopped by SIGINT, as a shell reports a process killed by it.
constexpr int kInterruptedExit = 130;

}  // namespace sbp
