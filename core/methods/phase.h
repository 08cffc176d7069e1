// Phases of a BP step ("forward", "head", "layer", "kv_path", ...): each method marks them with a Phase scope.
// The step's wall time per phase is summed here; a profiler may listen to the same marks to attribute memory.
#pragma once

#include <chrono>

#include <c10/core/Device.h>
#include <string>
#include <vector>

namespace sbp {

struct PhaseTime {
  std::string name;
  double seconds = 0;
  int count = 0;  // scopes entered under this name
};

// The analytic matrix-product FLOPs a method computes inside one phase of a step (core/methods/flop_model.h): its
// seconds over these give the phase's achieved rate, beside the machine's GEMM rate.
struct PhaseFlops {
  std::string name;
  double flops = 0;
};

// Receives every phase entry and exit (the CPU memory meter uses it for per-phase peaks), and the start of each
// decoder layer's work in the forward and the backward (a progress display uses it). At most one; a listener that
// sits in front of another (experiments/step_progress.h) passes every call on.
class PhaseListener {
 public:
  virtual ~PhaseListener() = default;
  virtual void enter_phase(const std::string& name) = 0;
  virtual void leave_phase(const std::string& name) = 0;
  virtual void enter_layer(int /*layer*/) {}
  virtual void leave_layer(int /*layer*/) {}
};
void set_phase_listener(PhaseListener* listener);
PhaseListener* phase_listener();
// A method starts or ends decoder layer `layer`'s forward or backward (BackpropMethod::LayerInUse marks both).
void mark_layer(int layer, bool begin);

// Makes `listener` the phase listener while alive, then restores the one before (e.g. a CUDA meter for a GPU step,
// then the CPU meter again).
class PhaseListenerScope {
 public:
  explicit PhaseListenerScope(PhaseListener& listener);
  ~PhaseListenerScope();
  PhaseListenerScope(const PhaseListenerScope&) = delete;
  PhaseListenerScope& operator=(const PhaseListenerScope&) = delete;

 private:
  PhaseListener* previous_;
};

// Waits for every stream of a CUDA device (what a wall-clock time of GPU work needs); nothing on the CPU. Phase
// scopes do not call it: on CUDA their times are host times of launching the phase's kernels.
void synchronize(c10::Device device);

class PhaseClock {
 public:
  const std::vector<PhaseTime>& totals() const { return totals_; }
  void add(const std::string& name, double seconds);

 private:
  std::vector<PhaseTime> totals_;  // in order of first entry
};

class Phase {
 public:
  Phase(PhaseClock& clock, std::string name);
  ~Phase();
  Phase(const Phase&) = delete;
  Phase& operator=(const Phase&) = delete;

 private:
  PhaseClock& clock_;
  std::string name_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace sbp
