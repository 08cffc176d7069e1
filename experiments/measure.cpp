#include "experiments/measure.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <new>
#include <optional>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "core/methods/phase.h"
#include "core/training/trainer.h"
#include "experiments/step_progress.h"
#include "profiler/cuda_meter.h"
#include "core/io/input_error.h"

namespace sbp {

double gemm_flops_per_second(c10::ScalarType dtype, std::int64_t n, int repeats, c10::Device device) {
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  const auto a = at::randn({n, n}, options), b = at::randn({n, n}, options);
  auto out = at::mm(a, b);  // warm-up, and the output buffer
  double best = 0;
  for (int r = 0; r < repeats; ++r) {
    synchronize(device);
    const auto start = std::chrono::steady_clock::now();
    at::mm_out(out, a, b);
    synchronize(device);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, 2.0 * double(n) * double(n) * double(n) / seconds);
  }
  return best;
}

const char* step_status_name(StepStatus status) {
  switch (status) {
    case StepStatus::finished: return "finished";
    case StepStatus::oom: return "oom";
  }
  return "?";
}

double Measurement::median_seconds() const {
  if (bp_seconds.empty()) return 0;
  auto v = bp_seconds;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

namespace {

// One step as the measurement sees it: its loss, BP seconds and phases.
struct MeasuredStep {
  double loss = 0, bp_seconds = 0;
  std::vector<PhaseTime> phases;
};

// The budget of a step on either meter, `held` bytes live before it not counted: the CPU meter names the budget as
// given; CUDA's caps the reserved bytes, held ones included.
void set_step_budget(CpuMemoryMeter& meter, std::int64_t budget_bytes, std::int64_t held) {
  meter.set_budget_bytes(budget_bytes, held);
}
void set_step_budget(CudaMemoryMeter& meter, std::int64_t budget_bytes, std::int64_t held) {
  meter.set_budget_bytes(budget_bytes + held);
}

// The measuring loop of measure_method and measure_training on either meter (CpuMemoryMeter and CudaMemoryMeter answer
// the same calls). `owned_bytes` is what the step's peak counts besides what it allocates: the model's weights and,
// in training, the optimizer's states as they are before the step.
template <typename Meter, typename Step, typename Owned>
Measurement measure_with(Meter& meter, Model& model, const Step& step, const Owned& owned_bytes, int warmup, int repeats,
                         std::int64_t budget_bytes, bool report_progress) {
  Measurement m;
  // The model's weights: the base and, under LoRA, the adapters (trainable weights the step also needs).
  m.weight_bytes = model_weight_bytes(model);
  for (int i = 0; i < warmup + repeats; ++i) {
    model.zero_grad();  // the previous step's gradients are not part of this step's memory
    meter.reset_peak();
    const auto held = meter.current_bytes() - owned_bytes();  // live before the step, not the model's
    if (budget_bytes > 0) set_step_budget(meter, budget_bytes, held);
    try {
      std::optional<StepProgress> progress;
      if (report_progress)
        progress.emplace(fmt::format("step {} of {}", i + 1, warmup + repeats), int(model.config().num_hidden_layers));
      const MeasuredStep r = step();
      progress.reset();
      meter.set_budget_bytes(0);
      m.loss = r.loss;
      m.phases = r.phases;
      if (i >= warmup) m.bp_seconds.push_back(r.bp_seconds);
    } catch (const c10::OutOfMemoryError& e) {  // the budget's, or a block the system refused (the meters name it)
      meter.set_budget_bytes(0);
      m.status = StepStatus::oom;
      m.error = e.what_without_backtrace();
    } catch (const std::bad_alloc&) {  // a C++ container the system refused, beside the tensors
      meter.set_budget_bytes(0);
      m.status = StepStatus::oom;
      m.error = "out of memory: a C++ allocation failed (std::bad_alloc)";
    }
    m.peak_bytes = std::max(m.peak_bytes, meter.peak_bytes() - held);
    m.largest_allocation_bytes = std::max(m.largest_allocation_bytes, meter.largest_allocation_bytes());
    m.phase_peaks = meter.phase_peaks();
    for (auto& p : m.phase_peaks) p.peak_bytes -= held;
    if (!m.finished()) break;
  }
  return m;
}

template <typename Step, typename Owned>
Measurement measure_on_device(Model& model, const Step& step, const Owned& owned_bytes, int warmup, int repeats,
                              std::int64_t budget_bytes, bool report_progress) {
  if (model.device().is_cuda()) {
    auto& meter = CudaMemoryMeter::for_device(model.device().index());
    if (!meter.available()) throw InputError("CUDA memory meter: " + meter.reason());
    const PhaseListenerScope listening(meter);  // per-phase peaks from the CUDA meter for this step
    auto m = measure_with(meter, model, step, owned_bytes, warmup, repeats, budget_bytes, report_progress);
    m.reserved_peak_bytes = meter.reserved_peak_bytes();
    return m;
  }
  return measure_with(CpuMemoryMeter::install(), model, step, owned_bytes, warmup, repeats, budget_bytes,
                      report_progress);
}

}  // namespace

Measurement measure_method(Model& model, BackpropMethod& method, const Objective& objective, const Batch& batch,
                           int warmup, int repeats, std::int64_t budget_bytes, bool report_progress) {
  const auto weights = model_weight_bytes(model);
  return measure_on_device(
      model,
      [&] {
        const auto r = method.step(model, objective, batch);
        return MeasuredStep{r.loss, r.bp_seconds, r.phases};
      },
      [&] { return weights; }, warmup, repeats, budget_bytes, report_progress);
}

Measurement measure_training(Trainer& trainer, const Batch& batch, int warmup, int repeats, std::int64_t budget_bytes) {
  const auto weights = model_weight_bytes(trainer.model());
  return measure_on_device(
      trainer.model(),
      [&] {
        const auto r = trainer.step(batch);
        return MeasuredStep{r.loss, r.bp_seconds, {}};
      },
      [&] { return weights + trainer.held_bytes(); }, warmup, repeats, budget_bytes, /*report_progress=*/false);
}

std::int64_t model_weight_bytes(const Model& model) {
  std::int64_t bytes = 0;
  for (const auto& p : model.parameters()) bytes += std::int64_t(p.tensor.nbytes());
  for (const auto& p : model.adapters()) bytes += std::int64_t(p.tensor.nbytes());
  return bytes;
}

ByteUnit byte_unit_for(std::int64_t largest_bytes) {
  const double b = std::abs(double(largest_bytes));
  if (b >= 1024.0 * 1024 * 1024) return {1024.0 * 1024 * 1024, "GiB", 2};
  if (b >= 1024.0 * 1024) return {1024.0 * 1024, "MiB", 1};
  return {1024.0, "KiB", 1};
}

std::string format_bytes(std::int64_t bytes, const ByteUnit& unit) {
  return fmt::format("{:.{}f} {}", double(bytes) / unit.bytes, unit.decimals, unit.name);
}

std::string format_bytes(std::int64_t bytes) { return format_bytes(bytes, byte_unit_for(bytes)); }

}  // namespace sbp
