#include "core/model/checkpoint_io.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "core/io/dtype.h"
#include "core/io/input_error.h"

namespace sbp {

std::unique_ptr<Model> load_model_dir(const std::filesystem::path& dir, c10::ScalarType dtype) {
  if (!std::filesystem::is_directory(dir)) throw InputError(dir.string() + ": not a checkpoint folder");
  auto config = read_config_json(dir / "config.json");
  const auto tensors = read_safetensors_dir(dir);
  return std::make_unique<Model>(std::move(config), dtype, tensors, dir.string());
}

void save_model_dir(const Model& model, const std::filesystem::path& dir, std::uint64_t max_shard_bytes) {
  std::filesystem::create_directories(dir);
  TensorList tensors;
  for (const auto& p : model.parameters()) tensors.push_back({p.name, p.tensor.detach()});
  write_safetensors_dir(dir, tensors, max_shard_bytes, {{"format", "pt"}});
  write_file_atomically(dir / "config.json", config_to_json(model.config(), hf_dtype_name(model.dtype())));
}

void load_adapter_dir(Model& model, const std::filesystem::path& dir, const LoraConfig& requested) {
  if (!std::filesystem::is_directory(dir)) throw InputError(dir.string() + ": not an adapter folder");
  const auto config_file = dir / "adapter_config.json";
  auto config = read_adapter_config(config_file);
  if (requested.enabled()) {
    auto contradiction = [&](const std::string& key, const std::string& theirs, const std::string& ours) {
      throw InputError(config_file.string() + ": key '" + key + "' is " + theirs + " but --lora says " + ours);
    };
    if (config.rank != requested.rank)
      contradiction("r", std::to_string(config.rank), "rank=" + std::to_string(requested.rank));
    if (config.alpha != requested.alpha)
      contradiction("lora_alpha", fmt::format("{}", config.alpha), fmt::format("alpha={}", requested.alpha));
    if (config.targets != requested.targets) {
      auto list = [](const LoraConfig& c) {
        std::string out;
        for (const auto& t : lora_target_names())
          if (c.targets.count(t)) out += (out.empty() ? "" : ",") + t;
        return out;
      };
      contradiction("target_modules", list(config), "targets=" + list(requested));
    }
  }
  const auto weights = dir / "adapter_model.safetensors";
  model.load_lora(config, read_safetensors(weights), weights.string());
}

void save_adapter_dir(const Model& model, const std::filesystem::path& dir, const std::string& base_model) {
  if (!model.lora().enabled()) throw InputError("--save-adapter needs --lora or --adapter");
  std::filesystem::create_directories(dir);
  TensorList tensors;
  for (const auto& a : model.adapters()) tensors.push_back({a.name, a.tensor.detach()});
  write_safetensors(dir / "adapter_model.safetensors", tensors, {{"format", "pt"}});
  write_file_atomically(dir / "adapter_config.json", adapter_config_json(model.lora(), base_model));
}

void save_gradients(const Model& model, const std::filesystem::path& file,
                    const std::map<std::string, std::string>& metadata) {
  write_safetensors(file, model.gradients(), metadata);
}

}  // namespace sbp
