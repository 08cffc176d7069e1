#include "core/training/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <sstream>
#include <stdexcept>

#include "core/io/spec.h"
#include "core/io/input_error.h"

namespace sbp {

LrSchedule parse_lr_schedule(const std::string& text) {
  // "kind,key=value,...": the form HF's lr_scheduler_type + kwargs suggest; core/spec.h checks the options.
  Spec spec;
  spec.kind = "lr schedule";
  std::stringstream items(text);
  std::getline(items, spec.name, ',');
  if (spec.name != "constant" && spec.name != "cosine")
    throw InputError("lr schedule '" + text + "': unknown schedule '" + spec.name + "' (constant, cosine)");
  for (std::string item; std::getline(items, item, ',');) {
    const auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size())
      throw InputError("lr schedule '" + text + "': expected key=value, got '" + item + "'");
    if (!spec.options.emplace(item.substr(0, eq), item.substr(eq + 1)).second)
      throw InputError("lr schedule '" + text + "': key '" + item.substr(0, eq) + "' given twice");
  }
  if (!text.empty() && text.back() == ',') throw InputError("lr schedule '" + text + "': trailing ','");
  spec.check_keys({"warmup"});
  return {spec.name == "cosine" ? ScheduleKind::Cosine : ScheduleKind::Constant, spec.get_int("warmup", 0, 0)};
}

const char* schedule_kind_name(ScheduleKind kind) { return kind == ScheduleKind::Cosine ? "cosine" : "constant"; }

std::string lr_schedule_spec(const LrSchedule& schedule) {
  return schedule_kind_name(schedule.kind) +
         (schedule.warmup ? ",warmup=" + std::to_string(schedule.warmup) : std::string());
}

double lr_at(const LrSchedule& schedule, double base_lr, std::int64_t step, std::int64_t total_steps) {
  if (step < 0 || total_steps < 0)
    throw InputError("lr_at: step " + std::to_string(step) + " and total_steps " +
                                std::to_string(total_steps) + " must be >= 0");
  const std::int64_t warmup = schedule.warmup;
  double lambda = 1.0;
  if (step < warmup) {
    // float(current_step) / float(max(1, num_warmup_steps)) in both schedules.
    lambda = double(step) / double(std::max<std::int64_t>(1, warmup));
  } else if (schedule.kind == ScheduleKind::Cosine) {
    const double progress = double(step - warmup) / double(std::max<std::int64_t>(1, total_steps - warmup));
    // math.pi * float(num_cycles) * 2.0 * progress, left to right: pi * 0.5 and * 2.0 are exact.
    const double factor = 0.5 * (1.0 + std::cos(std::numbers::pi * 0.5 * 2.0 * progress));
    lambda = factor > 0.0 ? factor : 0.0;  // Python's max(0.0, factor): 0.0 unless factor > 0.0
  }
  return base_lr * lambda;  // LambdaLR.get_lr: base_lr * lmbda(last_epoch)
}

}  // namespace sbp
