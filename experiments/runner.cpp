#include "experiments/runner.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "core/checkpoint_io.h"
#include "core/safetensors.h"

namespace sbp {

std::string ModelSource::describe() const {
  if (!preset.empty()) return preset;
  if (!config_file.empty()) return "config:" + config_file;
  return "load:" + load_dir;
}

std::unique_ptr<Model> build_model(const ModelSource& s, c10::ScalarType dtype, std::uint64_t seed) {
  const int given = !s.preset.empty() + !s.config_file.empty() + !s.load_dir.empty();
  if (given != 1) throw std::invalid_argument("give exactly one of --preset, --config, --load");
  if (!s.load_dir.empty()) return load_model_dir(s.load_dir, dtype);
  auto config = s.preset.empty() ? read_config_json(s.config_file) : preset_config(s.preset);
  return std::make_unique<Model>(std::move(config), dtype, seed);
}

Batch read_batch_file(const std::filesystem::path& file) {
  const auto tensors = read_safetensors(file);
  auto find = [&](const std::string& name) {
    for (const auto& t : tensors)
      if (t.name == name) return t.tensor;
    throw std::invalid_argument(file.string() + ": missing tensor '" + name + "'");
  };
  return {find("input_ids"), find("labels"), find("attention_mask")};
}

void write_batch_file(const Batch& b, const std::filesystem::path& file) {
  write_safetensors(file, {{"input_ids", b.input_ids}, {"labels", b.labels}, {"attention_mask", b.attention_mask}});
}

double Measurement::median_seconds() const {
  if (bp_seconds.empty()) return 0;
  auto v = bp_seconds;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

Measurement measure_method(Model& model, BackpropMethod& method, Objective& objective, const Batch& batch,
                           int warmup, int repeats, std::int64_t budget_bytes) {
  auto& meter = CpuMemoryMeter::install();
  Measurement m;
  for (const auto& p : model.parameters()) m.weight_bytes += std::int64_t(p.tensor.nbytes());
  for (int i = 0; i < warmup + repeats; ++i) {
    model.zero_grad();  // the previous step's gradients are not part of this step's memory
    meter.reset_peak();
    const auto held = meter.current_bytes() - m.weight_bytes;  // live before the step, not the model's
    if (budget_bytes > 0) meter.set_budget_bytes(budget_bytes + held);
    try {
      const auto r = method.step(model, objective, batch);
      meter.set_budget_bytes(0);
      m.loss = r.loss;
      m.phases = r.phases;
      if (i >= warmup) m.bp_seconds.push_back(r.bp_seconds);
    } catch (const c10::OutOfMemoryError& e) {
      meter.set_budget_bytes(0);
      m.status = "oom";
      m.error = e.what_without_backtrace();
    }
    m.peak_bytes = std::max(m.peak_bytes, meter.peak_bytes() - held);
    m.largest_allocation_bytes = std::max(m.largest_allocation_bytes, meter.largest_allocation_bytes());
    m.phase_peaks = meter.phase_peaks();
    for (auto& p : m.phase_peaks) p.peak_bytes -= held;
    if (m.status != "passed") break;
  }
  return m;
}

std::string format_bytes(std::int64_t bytes) {
  const double b = double(bytes);
  if (std::abs(b) >= 1024.0 * 1024 * 1024) return fmt::format("{:.2f} GiB", b / (1024.0 * 1024 * 1024));
  if (std::abs(b) >= 1024.0 * 1024) return fmt::format("{:.1f} MiB", b / (1024.0 * 1024));
  return fmt::format("{:.1f} KiB", b / 1024.0);
}

void check_new_output(const std::filesystem::path& file, bool force, const std::string& flag) {
  if (!force && std::filesystem::exists(file))
    throw std::invalid_argument(flag + " " + file.string() + ": file exists; results are never overwritten silently "
                                "(choose another name, or pass --force)");
}

}  // namespace sbp
