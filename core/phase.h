// Phases of a BP step ("forward", "head", "layer", "kv_path", ...): each method marks them with a Phase scope.
// The step's wall time per phase is summed here; a profiler may listen to the same marks to attribute memory.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace sbp {

struct PhaseTime {
  std::string name;
  double seconds = 0;
  int count = 0;  // scopes entered under this name
};

// Receives every phase entry and exit (the CPU memory meter uses it for per-phase peaks). At most one.
class PhaseListener {
 public:
  virtual ~PhaseListener() = default;
  virtual void enter_phase(const std::string& name) = 0;
  virtual void leave_phase(const std::string& name) = 0;
};
void set_phase_listener(PhaseListener* listener);

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
