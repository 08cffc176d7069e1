// Measuring a BP method or a training step on its device: peak bytes from that device's meter (every tensor byte on
// the CPU, the caching allocator's on CUDA), BP seconds over repeats, the status; and the yardsticks the tables print
// beside them (the machine's GEMM rate, the model's own bytes, a byte count for people).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "core/methods/method.h"
#include "core/objectives/batch.h"
#include "core/objectives/objective.h"
#include "core/model/model.h"
#include "profiler/cpu_meter.h"

namespace sbp {

class Trainer;

// How a measured step ended: it finished, or it went over the budget (or asked for memory the system refused).
enum class StepStatus { finished, oom };
const char* step_status_name(StepStatus status);  // "finished", "oom": as records and tables write it

struct Measurement {
  StepStatus status = StepStatus::finished;
  std::string error;
  double loss = 0;
  std::vector<double> bp_seconds;  // one per measured repeat
  // Bytes live at the step's peak, counting the model's weights and what the step allocated; bytes the caller held
  // before the step (reference gradients, other models) are not counted.
  std::int64_t peak_bytes = 0;
  std::int64_t weight_bytes = 0;  // base parameters and LoRA adapters
  std::int64_t largest_allocation_bytes = 0;  // largest single block (no [T, T] tile ever exists in StreamBP)
  // CUDA only (-1 on the CPU): the caching allocator's reserved-bytes peak of the last step, what cudaMalloc held
  // (CUPTI's memory curve is the same quantity).
  std::int64_t reserved_peak_bytes = -1;
  std::vector<PhaseTime> phases;       // of the last repeat
  std::vector<PhasePeak> phase_peaks;  // in the same accounting as peak_bytes
  double median_seconds() const;
  bool finished() const { return status == StepStatus::finished; }
};

// Runs warmup + repeats steps on the model's device, measured by that device's meter: the CPU meter (every tensor
// byte), or on CUDA the caching allocator's allocated bytes (profiler/cuda_meter.h). budget_bytes > 0 caps peak_bytes
// (the step then ends with status "oom"); on CUDA it caps the allocator's reserved bytes, as a GPU of that size would.
// An allocation the system refuses ends the step with status "oom" too, naming its size. `report_progress`: a long
// step's phase and layer on stderr (experiments/step_progress.h).
Measurement measure_method(Model& model, BackpropMethod& method, const Objective& objective, const Batch& batch,
                           int warmup, int repeats, std::int64_t budget_bytes, bool report_progress = false);

// measure_method for training steps (BP + optimizer update) of `trainer` on its model: the peak counts the optimizer's
// states too (bp_seconds: the BP of each step, without the update). Its first step creates the states after the BP, so a peak with the
// states present during the BP needs repeats + warmup >= 2 (the peak is the largest of all steps).
Measurement measure_training(Trainer& trainer, const Batch& batch, int warmup, int repeats, std::int64_t budget_bytes);

std::string format_bytes(std::int64_t bytes);  // "1.23 GiB"
// One unit for a column of byte counts: the one format_bytes picks for the column's largest entry, so that a column
// never mixes "1003.3 MiB" and "1.26 GiB".
struct ByteUnit {
  double bytes;      // bytes per unit
  const char* name;  // "GiB"
  int decimals;
};
ByteUnit byte_unit_for(std::int64_t largest_bytes);
std::string format_bytes(std::int64_t bytes, const ByteUnit& unit);
// The model's own bytes: base weights and LoRA adapters (fp32 masters in mixed precision), what a step's peak counts.
std::int64_t model_weight_bytes(const Model& model);
// This machine's dense GEMM rate in `dtype` at the current thread count: the best of `repeats` n x n x n products
// (after one warm-up) on `device`, in FLOP/s: the yardstick of a method's achieved FLOP/s.
double gemm_flops_per_second(c10::ScalarType dtype, std::int64_t n = 2048, int repeats = 5,
                             c10::Device device = c10::Device(c10::kCPU));
}  // namespace sbp
