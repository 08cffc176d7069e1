#include "experiments/runner.h"

#include <algorithm>
#include <chrono>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "core/model/checkpoint_io.h"
#include "core/io/dtype.h"
#include "core/methods/memory_model.h"
#include "core/io/safetensors.h"
#include "core/methods/streaming.h"
#include "core/training/trainer.h"
#include "profiler/calibration.h"
#include "profiler/cuda_meter.h"

namespace sbp {

std::unique_ptr<Model> build_model(const ModelSource& s, c10::ScalarType dtype, std::uint64_t seed) {
  const int given = !s.preset.empty() + !s.config_file.empty() + !s.load_dir.empty();
  if (given != 1) throw std::invalid_argument("give exactly one of --preset, --config, --load");
  if (!s.load_dir.empty()) return load_model_dir(s.load_dir, dtype);
  auto config = s.preset.empty() ? read_config_json(s.config_file) : preset_config(s.preset);
  return std::make_unique<Model>(std::move(config), dtype, seed);
}

Batch read_batch_file(const std::filesystem::path& file) {
  Batch batch;
  for (const auto& t : read_safetensors(file)) {
    if (t.name == "input_ids")
      batch.input_ids = t.tensor;
    else if (t.name == "attention_mask")
      batch.attention_mask = t.tensor;
    else
      batch.fields[t.name] = t.tensor;  // the objective checks its own (names, shapes, dtypes)
  }
  if (!batch.input_ids.defined()) throw std::invalid_argument(file.string() + ": missing tensor 'input_ids'");
  if (!batch.attention_mask.defined()) throw std::invalid_argument(file.string() + ": missing tensor 'attention_mask'");
  return batch;
}

void write_batch_file(const Batch& b, const std::filesystem::path& file) {
  TensorList tensors = {{"input_ids", b.input_ids}, {"attention_mask", b.attention_mask}};
  for (const auto& [name, tensor] : b.fields) tensors.push_back({name, tensor});
  write_safetensors(file, tensors);
}

namespace {

// Chunks of the reference pass: StreamBP's defaults (the pass is StreamBP's forward without checkpoints).
constexpr std::int64_t kReferenceLayerChunk = 512, kReferenceHeadChunk = 1024;

// The first architecture field in which two configs differ, or "".
std::string architecture_difference(const ModelConfig& a, const ModelConfig& b) {
  const std::pair<const char*, std::pair<std::int64_t, std::int64_t>> fields[] = {
      {"vocab_size", {a.vocab_size, b.vocab_size}},
      {"hidden_size", {a.hidden_size, b.hidden_size}},
      {"intermediate_size", {a.intermediate_size, b.intermediate_size}},
      {"num_hidden_layers", {a.num_hidden_layers, b.num_hidden_layers}},
      {"num_attention_heads", {a.num_attention_heads, b.num_attention_heads}},
      {"num_key_value_heads", {a.num_key_value_heads, b.num_key_value_heads}},
      {"head_dim", {a.head_dim, b.head_dim}},
      {"qk_norm", {a.qk_norm, b.qk_norm}},
      {"attention_bias", {a.attention_bias, b.attention_bias}},
      {"tie_word_embeddings", {a.tie_word_embeddings, b.tie_word_embeddings}}};
  for (const auto& [name, values] : fields)
    if (values.first != values.second)
      return std::string(name) + " " + std::to_string(values.second) + " (the policy has " + std::to_string(values.first) + ")";
  return "";
}

}  // namespace

Workload make_workload(const Model& model, const Objective& objective, const Batch& batch) {
  Workload w{model.config(), model.dtype(), batch.batch_size(), batch.seq_len(), objective.buffer_bytes_per_token(),
             objective.needs_statistics()};
  w.threads = at::get_num_threads();
  w.workspaces = machine_workspaces(model.device());
  w.grad_dtype = model.grad_dtype();
  const auto& lora = model.lora();
  if (lora.enabled()) {
    w.lora_rank = lora.rank;
    w.lora_parameters = lora_parameter_count(model.config(), lora);  // ZeRO-3 empties the adapters between uses
    for (const auto& t : lora.targets) (t == "gate" || t == "up" || t == "down" ? w.lora_mlp_targets : w.lora_attention_targets)++;
    w.lora_targets.assign(lora.targets.begin(), lora.targets.end());
  }
  return w;
}

void apply_lora(Model& model, const std::string& lora_spec, const std::string& adapter_dir, std::uint64_t seed) {
  const auto requested = lora_spec.empty() ? LoraConfig{} : parse_lora_spec(lora_spec);
  if (!adapter_dir.empty())
    load_adapter_dir(model, adapter_dir, requested);
  else if (requested.enabled())
    model.add_lora(requested, seed);
}

ReferencePass complete_batch(const Model& model, const Objective& objective, Batch& batch, const std::string& source,
                             bool random, const std::string& ref_dir, c10::ScalarType dtype, std::uint64_t seed) {
  if (!ref_dir.empty() && batch.has("ref_logps"))
    throw std::invalid_argument(source + " carries ref_logps and --ref " + ref_dir + " is given: use one of them");
  const bool lora = model.lora().enabled();
  if (random && objective.wants_policy_logps())
    objective.add_synthetic_logps(batch, sequence_logps(model, batch.input_ids, objective.temperature()), seed,
                                  /*reference_given=*/!ref_dir.empty() || lora);
  ReferencePass pass;
  if (!objective.needs_reference(batch)) {
    if (!ref_dir.empty())
      throw std::invalid_argument("--ref " + ref_dir + ": objective " + objective.spec() + " reads no reference log-probs");
    return pass;
  }
  if (ref_dir.empty() && !lora)
    throw std::invalid_argument(source + ": objective " + objective.name() + " needs ref_logps in the batch or --ref DIR (a reference model)");
  // The pass runs where the policy lives, measured by that device's meter.
  auto& cpu_meter = CpuMemoryMeter::install();
  auto* cuda_meter = model.device().is_cuda() ? &CudaMemoryMeter::for_device(model.device().index()) : nullptr;
  const auto live_bytes = [&] { return cuda_meter ? cuda_meter->current_bytes() : cpu_meter.current_bytes(); };
  const auto before = live_bytes();
  cuda_meter ? cuda_meter->reset_peak() : cpu_meter.reset_peak();
  const auto start = std::chrono::steady_clock::now();
  if (ref_dir.empty()) {  // LoRA: the base model is the reference, on its own hidden states
    const Model::AdaptersDisabled base(model);
    batch = objective.with_reference(batch, sequence_logps(model, batch.input_ids, objective.temperature(),
                                                           kReferenceLayerChunk, kReferenceHeadChunk));
  } else {
    const auto reference = load_model_dir(ref_dir, dtype);
    reference->to(model.device());
    if (const auto diff = architecture_difference(model.config(), reference->config()); !diff.empty())
      throw std::invalid_argument(ref_dir + "/config.json: the reference model must have the policy's architecture and "
                                  "vocabulary; it has " + diff);
    batch = objective.with_reference(batch, sequence_logps(*reference, batch.input_ids, objective.temperature(),
                                                           kReferenceLayerChunk, kReferenceHeadChunk));
  }
  pass.ran = true;
  pass.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  synchronize(model.device());
  pass.peak_bytes = (cuda_meter ? cuda_meter->peak_bytes() : cpu_meter.peak_bytes()) - before;
  auto workload = make_workload(model, objective, batch);
  workload.lora_rank = workload.lora_parameters = 0;  // the reference computes the base function
  pass.model = reference_pass_memory(workload, kReferenceLayerChunk, kReferenceHeadChunk,
                                     /*separate_weights=*/!ref_dir.empty());
  return pass;
}

Batch prepared_random_batch(const Model& model, Objective& objective, std::int64_t batch_size, std::int64_t seq_len,
                            std::int64_t group, std::uint64_t seed) {
  auto batch = objective.random_batch(model.config(),
                                      {batch_size, seq_len, 0.0, objective.name() == "sft" ? 0.1 : 0.0, seed, group})
                   .to(model.device());
  complete_batch(model, objective, batch, "random batch", true, "", model.dtype(), seed);
  objective.prepare(batch, model.config(), "random batch");
  return batch;
}

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

// The measuring loop of measure_method and measure_training on either meter (CpuMemoryMeter and CudaMemoryMeter answer
// the same calls). `owned_bytes` is what the step's peak counts besides what it allocates: the model's weights and,
// in training, the optimizer's states as they are before the step.
template <typename Meter, typename Step, typename Owned>
Measurement measure_with(Meter& meter, Model& model, const Step& step, const Owned& owned_bytes, int warmup, int repeats,
                         std::int64_t budget_bytes) {
  Measurement m;
  // The model's weights: the base and, under LoRA, the adapters (trainable weights the step also needs).
  m.weight_bytes = model_weight_bytes(model);
  for (int i = 0; i < warmup + repeats; ++i) {
    model.zero_grad();  // the previous step's gradients are not part of this step's memory
    meter.reset_peak();
    const auto held = meter.current_bytes() - owned_bytes();  // live before the step, not the model's
    if (budget_bytes > 0) meter.set_budget_bytes(budget_bytes + held);
    try {
      const MeasuredStep r = step();
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

template <typename Step, typename Owned>
Measurement measure_on_device(Model& model, const Step& step, const Owned& owned_bytes, int warmup, int repeats,
                              std::int64_t budget_bytes) {
  if (model.device().is_cuda()) {
    auto& meter = CudaMemoryMeter::for_device(model.device().index());
    if (!meter.available()) throw std::runtime_error("CUDA memory meter: " + meter.reason());
    const PhaseListenerScope listening(meter);  // per-phase peaks from the CUDA meter for this step
    auto m = measure_with(meter, model, step, owned_bytes, warmup, repeats, budget_bytes);
    m.reserved_peak_bytes = meter.reserved_peak_bytes();
    return m;
  }
  return measure_with(CpuMemoryMeter::install(), model, step, owned_bytes, warmup, repeats, budget_bytes);
}

}  // namespace

Measurement measure_method(Model& model, BackpropMethod& method, Objective& objective, const Batch& batch,
                           int warmup, int repeats, std::int64_t budget_bytes) {
  const auto weights = model_weight_bytes(model);
  return measure_on_device(
      model,
      [&] {
        const auto r = method.step(model, objective, batch);
        return MeasuredStep{r.loss, r.bp_seconds, r.phases};
      },
      [&] { return weights; }, warmup, repeats, budget_bytes);
}

Measurement measure_training(Trainer& trainer, const Batch& batch, int warmup, int repeats, std::int64_t budget_bytes) {
  const auto weights = model_weight_bytes(trainer.model());
  return measure_on_device(
      trainer.model(),
      [&] {
        const auto r = trainer.step(batch);
        return MeasuredStep{r.loss, r.bp_seconds, {}};
      },
      [&] { return weights + trainer.held_bytes(); }, warmup, repeats, budget_bytes);
}

std::vector<std::string> split_list(const std::string& text, char sep) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

std::int64_t model_weight_bytes(const Model& model) {
  std::int64_t bytes = 0;
  for (const auto& p : model.parameters()) bytes += std::int64_t(p.tensor.nbytes());
  for (const auto& p : model.adapters()) bytes += std::int64_t(p.tensor.nbytes());
  return bytes;
}

std::string format_bytes(std::int64_t bytes) {
  const double b = double(bytes);
  if (std::abs(b) >= 1024.0 * 1024 * 1024) return fmt::format("{:.2f} GiB", b / (1024.0 * 1024 * 1024));
  if (std::abs(b) >= 1024.0 * 1024) return fmt::format("{:.1f} MiB", b / (1024.0 * 1024));
  return fmt::format("{:.1f} KiB", b / 1024.0);
}

void check_new_folder(const std::filesystem::path& folder, bool force, const std::string& flag) {
  if (!force && std::filesystem::exists(folder))
    throw std::invalid_argument(flag + " " + folder.string() + ": file exists; results are never overwritten silently "
                                "(choose another name, or pass --force)");
}

void check_new_output(const std::filesystem::path& file, bool force, const std::string& flag) {
  check_new_folder(file, force, flag);
  // Before the work, not after it: an output whose folder does not exist would fail only when written.
  const auto parent = std::filesystem::absolute(file).parent_path();
  if (!std::filesystem::is_directory(parent))
    throw std::invalid_argument(flag + " " + file.string() + ": the folder " + parent.string() +
                                " does not exist (create it first)");
}

}  // namespace sbp
