// Where a long step is, on stderr: the phase and the decoder layer it has reached, once the step has run for a
// while (a 30 000-token step runs for minutes and printed nothing until its end, issue #44). One line per layer and
// per outermost phase, or on a terminal one line rewritten in place and cleared when the step ends. Nothing is
// printed for a step shorter than the delay, so short runs and the tests' outputs stay as they are.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "core/methods/phase.h"

namespace sbp {

class StepProgress final : public PhaseListener {
 public:
  // While alive, the phase listener, in front of the one before it (a memory meter), to which it passes every call.
  // `label` names the step ("step 2 of 3"), `layers` the model's decoder layers; `out` must outlive it.
  StepProgress(std::string label, int layers, std::FILE* out = stderr, double delay_seconds = 2.0);
  ~StepProgress() override;
  StepProgress(const StepProgress&) = delete;
  StepProgress& operator=(const StepProgress&) = delete;

  void enter_phase(const std::string& name) override;
  void leave_phase(const std::string& name) override;
  void enter_layer(int layer) override;
  void leave_layer(int layer) override;

 private:
  // Prints where the step is (`new_line`: a line of its own when not rewriting one) once the delay has passed;
  // whether it printed.
  bool report(bool new_line);

  std::string label_;
  int layers_;
  std::FILE* out_;
  bool rewrite_;  // a terminal: one line, rewritten
  std::chrono::steady_clock::time_point start_;
  std::chrono::duration<double> delay_;
  PhaseListener* next_;
  std::vector<std::string> open_;  // the open phases, outermost first
  int layer_ = -1;                 // the layer being worked on; -1 outside the layers
  std::string last_phase_line_;    // the outermost phase a line was printed for
  bool printed_ = false;
};

}  // namespace sbp
