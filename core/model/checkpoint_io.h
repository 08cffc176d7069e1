// HF checkpoint folders (config.json + model.safetensors or a sharded index) and gradient files.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <string>

#include <c10/core/ScalarType.h>

#include "core/model/model.h"

namespace sbp {

// Reads <dir>/config.json and the weights; casts them to `dtype`. Errors name the file and tensor.
std::unique_ptr<Model> load_model_dir(const std::filesystem::path& dir, c10::ScalarType dtype);
// Writes config.json and model.safetensors (shards above max_shard_bytes), each atomically.
void save_model_dir(const Model& model, const std::filesystem::path& dir,
                    std::uint64_t max_shard_bytes = std::uint64_t(5) << 30);
// A PEFT LoRA adapter folder: adapter_config.json + adapter_model.safetensors. Loading checks the adapter against the
// base (names, shapes) and, when `requested` (from --lora) is enabled, against its rank, alpha and targets; errors
// name the file and the tensor or key.
void load_adapter_dir(Model& model, const std::filesystem::path& dir, const LoraConfig& requested);
void save_adapter_dir(const Model& model, const std::filesystem::path& dir, const std::string& base_model);
// Every trainable parameter's gradient (HF names; PEFT names under LoRA), in the model dtype.
void save_gradients(const Model& model, const std::filesystem::path& file,
                    const std::map<std::string, std::string>& metadata = {});

}  // namespace sbp
