#include "profiler/op_profile.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <ostream>
#include <stdexcept>

#include <ATen/record_function.h>
#include <fmt/format.h>

namespace sbp {
namespace {

using Clock = std::chrono::steady_clock;

thread_local int t_depth = 0;  // RecordFunction scopes open on this thread

struct Started : at::ObserverContext {
  Clock::time_point start;
};

}  // namespace

struct OpProfile::State {
  std::mutex mutex;
  std::map<std::string, OpTime> by_name;
  at::CallbackHandle handle = 0;
};

namespace {
OpProfile::State* g_state = nullptr;  // the one active profile (callbacks are plain functions)

std::unique_ptr<at::ObserverContext> enter(const at::RecordFunction&) {
  if (t_depth++ > 0) return nullptr;  // nested: its time is part of the outer op's
  auto ctx = std::make_unique<Started>();
  ctx->start = Clock::now();
  return ctx;
}

void leave(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  --t_depth;
  if (ctx == nullptr || g_state == nullptr) return;
  const double seconds = std::chrono::duration<double>(Clock::now() - static_cast<Started*>(ctx)->start).count();
  std::lock_guard<std::mutex> lock(g_state->mutex);
  auto& op = g_state->by_name[fn.name()];
  op.calls += 1;
  op.seconds += seconds;
}
}  // namespace

OpProfile::OpProfile() : state_(std::make_unique<State>()) {
  if (g_state != nullptr) throw std::logic_error("OpProfile: another op profile is active");
  g_state = state_.get();
  state_->handle = at::addGlobalCallback(
      at::RecordFunctionCallback(&enter, &leave).scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
}

OpProfile::~OpProfile() {
  at::removeCallback(state_->handle);
  g_state = nullptr;
}

std::vector<OpTime> OpProfile::totals() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  std::vector<OpTime> out;
  for (const auto& [name, op] : state_->by_name) {
    out.push_back(op);
    out.back().name = name;
  }
  std::sort(out.begin(), out.end(), [](const OpTime& a, const OpTime& b) { return a.seconds > b.seconds; });
  return out;
}

void write_op_profile_csv(const std::vector<OpTime>& ops, double total_seconds, std::ostream& out) {
  out << "name,calls,seconds,share\n";
  for (const auto& op : ops)
    out << op.name << ',' << op.calls << ',' << fmt::format("{:.6f}", op.seconds) << ','
        << (total_seconds > 0 ? fmt::format("{:.4f}", op.seconds / total_seconds) : "") << '\n';
}

}  // namespace sbp
