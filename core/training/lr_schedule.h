// Learning-rate schedules as HF transformers defines them (transformers/optimization.py, 5.23), applied through
// torch's LambdaLR: lr = base_lr * lambda(step). Specs: "constant", "constant,warmup=K", "cosine", "cosine,warmup=K".
#pragma once

#include <cstdint>
#include <string>
#include "core/io/input_error.h"

namespace sbp {

enum class ScheduleKind { Constant, Cosine };

struct LrSchedule {
  ScheduleKind kind = ScheduleKind::Constant;
  std::int64_t warmup = 0;        // optimizer steps of linear warmup from 0
};

// Throws InputError naming the spec and the unknown kind, key or bad value.
LrSchedule parse_lr_schedule(const std::string& spec);
std::string lr_schedule_spec(const LrSchedule& schedule);  // canonical, "cosine,warmup=10"; parses back
const char* schedule_kind_name(ScheduleKind kind);        // "constant", "cosine"

// The learning rate of optimizer step `step` (0-based: the first step uses lambda(0), as LambdaLR sets it at
// construction) of `total_steps`. Bitwise equal to the lr that get_constant_schedule_with_warmup /
// get_cosine_schedule_with_warmup (num_cycles 0.5) put into the optimizer: the same double arithmetic, in the same
// order, with libm's cos. Throws InputError for a negative step or total.
double lr_at(const LrSchedule& schedule, double base_lr, std::int64_t step, std::int64_t total_steps);

}  // namespace sbp
