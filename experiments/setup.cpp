#include "experiments/setup.h"

#include <memory>

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include "core/io/dtype.h"
#include "core/model/config.h"
#include "core/model/model.h"
#include "core/objectives/catalogue.h"
#include "core/objectives/objective.h"
#include "experiments/device.h"
#include "core/model/checkpoint_io.h"
#include "core/model/lora.h"
#include "core/io/input_error.h"

namespace sbp {
namespace {
constexpr const char* kDefaultObjective = "sft";  // --objective's default, and a Setup's never parsed
}  // namespace

ModelSource ModelSource::or_preset(const std::string& name) const {
  ModelSource out = *this;
  if (preset.empty() && config_file.empty() && load_dir.empty()) out.preset = name;
  return out;
}

std::string ModelSource::describe() const {
  if (!preset.empty()) return preset;
  if (!config_file.empty()) return "config:" + config_file;
  return "load:" + load_dir;
}

c10::ScalarType Setup::model_dtype() const {
  if (dtype) return *dtype;
  return source.load_dir.empty() ? c10::kFloat : parse_dtype(read_config_dtype(source.load_dir + "/config.json"));
}

void Setup::apply_threads() const {
  if (threads > 0) at::set_num_threads(threads);
}

namespace {

// A dtype flag, parsed once: a name other than fp64, fp32 or bf16 is a usage error (exit 2) naming the flag.
void add_dtype_option(CLI::App& app, const std::string& flag, std::optional<c10::ScalarType>& dtype,
                      const std::string& help) {
  app.add_option_function<std::string>(flag, [&dtype](const std::string& name) { dtype = parse_dtype(name); }, help)
      ->check(CLI::IsMember({"fp64", "fp32", "bf16"}));
}

}  // namespace

void add_setup_options(CLI::App& app, Setup& s, SetupFlags flags) {
  const std::string presets = "named model preset (tiny, tiny-mha, qwen3-small, qwen3-small-mha, qwen3-0.6b ... qwen3-32b, llama-3.1-8b)";
  if (flags.default_preset) {
    app.add_option("--preset", s.source.preset, presets + "; default " + flags.default_preset + " when no --config/--load");
    app.parse_complete_callback([&s, preset = std::string(flags.default_preset)] { s.source = s.source.or_preset(preset); });
  } else {
    app.add_option("--preset", s.source.preset, presets + "; one of --preset, --config, --load is required");
  }
  app.add_option("--config", s.source.config_file, "HF config.json: random weights of that shape")->check(CLI::ExistingFile);
  if (flags.load)
    app.add_option("--load", s.source.load_dir, "HF checkpoint folder (config.json + safetensors)")->check(CLI::ExistingDirectory);
  if (flags.dtype)
    add_dtype_option(app, "--dtype", s.dtype, "fp64, fp32 or bf16 (default: the --load checkpoint's torch_dtype, else fp32)");
  if (flags.grad_dtype)
    add_dtype_option(app, "--grad-dtype", s.grad_dtype, "fp32 with --dtype bf16: mixed precision (bf16 compute; the "
                     "trainable tensors - all weights, or the LoRA adapters - are fp32 masters with fp32 gradients, "
                     "cast to bf16 where used, like torch.autocast); default: the dtype");
  if (flags.lora)
    app.add_option("--lora", s.lora_spec, "LoRA: rank=R,alpha=A,targets=all-linear|q,k,v,o,gate,up,down,init=peft|random "
                   "(alpha default 2R, targets all-linear: PEFT's meaning); the base is frozen");
  if (flags.adapter)
    app.add_option("--adapter", s.adapter_dir, "PEFT LoRA adapter folder (adapter_config.json + "
                   "adapter_model.safetensors)")->check(CLI::ExistingDirectory);
  auto objective = std::make_shared<std::string>(kDefaultObjective);
  app.add_option("--objective", *objective,
                 "objective spec: " + objectives_usage() + " (keys optional; defaults shown: TRL's)");
  if (flags.group)
    app.add_option("--group", s.group, "GRPO random batch: completions per prompt (default: the whole batch)")->check(CLI::PositiveNumber);
  auto device = std::make_shared<std::string>("cpu");
  if (flags.device) add_device_option(app, *device);
  app.add_option("--threads", s.threads, "intra-op threads (default: torch's)")->check(CLI::NonNegativeNumber);
  if (flags.seed) app.add_option("--seed", s.seed, "seed of the random weights, adapters and batch");
  // After every flag CLI11 checks, so that its rejections keep their order; the command then reads typed values.
  app.final_callback([&s, device, objective] {
    s.device = parse_device(*device);
    s.objective = make_objective(*objective);
    if (!s.lora_spec.empty()) s.lora = parse_lora_spec(s.lora_spec);
  });
}

std::unique_ptr<Model> build_model(const ModelSource& s, c10::ScalarType dtype, std::uint64_t seed) {
  const int given = !s.preset.empty() + !s.config_file.empty() + !s.load_dir.empty();
  if (given != 1) throw InputError("give exactly one of --preset, --config, --load");
  if (!s.load_dir.empty()) return load_model_dir(s.load_dir, dtype);
  auto config = s.preset.empty() ? read_config_json(s.config_file) : preset_config(s.preset);
  return std::make_unique<Model>(std::move(config), dtype, seed);
}

void apply_lora(Model& model, const LoraConfig& lora, const std::string& adapter_dir, std::uint64_t seed) {
  if (!adapter_dir.empty())
    load_adapter_dir(model, adapter_dir, lora);
  else if (lora.enabled())
    model.add_lora(lora, seed);
}

std::unique_ptr<Model> build_model(const Setup& s) {
  auto model = build_model(s.source, s.model_dtype(), s.seed);
  apply_lora(*model, s.lora, s.adapter_dir, s.seed);
  if (s.grad_dtype) model->set_grad_dtype(*s.grad_dtype);
  return model;
}

std::shared_ptr<const Objective> build_objective(const Setup& s) {
  return s.objective ? s.objective : std::shared_ptr<const Objective>(make_objective(kDefaultObjective));
}

}  // namespace sbp
