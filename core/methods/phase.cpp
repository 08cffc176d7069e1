#include "core/methods/phase.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace sbp {

void synchronize(c10::Device device) {
  if (device.is_cuda()) c10::impl::getDeviceGuardImpl(device.type())->synchronizeDevice(device.index());
}
namespace {
PhaseListener* g_listener = nullptr;
}

void set_phase_listener(PhaseListener* listener) { g_listener = listener; }
PhaseListener* phase_listener() { return g_listener; }

void mark_layer(int layer, bool begin) {
  if (!g_listener) return;
  if (begin)
    g_listener->enter_layer(layer);
  else
    g_listener->leave_layer(layer);
}

PhaseListenerScope::PhaseListenerScope(PhaseListener& listener) : previous_(g_listener) { g_listener = &listener; }
PhaseListenerScope::~PhaseListenerScope() { g_listener = previous_; }

void PhaseClock::add(const std::string& name, double seconds) {
  for (auto& t : totals_)
    if (t.name == name) {
      t.seconds += seconds;
      ++t.count;
      return;
    }
  totals_.push_back({name, seconds, 1});
}

Phase::Phase(PhaseClock& clock, std::string name)
    : clock_(clock), name_(std::move(name)), start_(std::chrono::steady_clock::now()) {
  if (g_listener) g_listener->enter_phase(name_);
}

Phase::~Phase() {
  if (g_listener) g_listener->leave_phase(name_);
  clock_.add(name_, std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
}

}  // namespace sbp
