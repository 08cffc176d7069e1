#include "core/checkpoint_io.h"

#include <ATen/ATen.h>

#include "core/dtype.h"

namespace sbp {

std::unique_ptr<Model> load_model_dir(const std::filesystem::path& dir, c10::ScalarType dtype) {
  if (!std::filesystem::is_directory(dir)) throw std::runtime_error(dir.string() + ": not a checkpoint folder");
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

void save_gradients(const Model& model, const std::filesystem::path& file,
                    const std::map<std::string, std::string>& metadata) {
  write_safetensors(file, model.gradients(), metadata);
}

}  // namespace sbp
