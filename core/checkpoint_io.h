// HF checkpoint folders (config.json + model.safetensors or a sharded index) and gradient files.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <string>

#include <c10/core/ScalarType.h>

#include "core/model.h"

namespace sbp {

// Reads <dir>/config.json and the weights; casts them to `dtype`. Errors name the file and tensor.
std::unique_ptr<Model> load_model_dir(const std::filesystem::path& dir, c10::ScalarType dtype);
// Writes config.json and model.safetensors (shards above max_shard_bytes), each atomically.
void save_model_dir(const Model& model, const std::filesystem::path& dir,
                    std::uint64_t max_shard_bytes = std::uint64_t(5) << 30);
// Every parameter's gradient under the parameter's HF name, in the model dtype.
void save_gradients(const Model& model, const std::filesystem::path& file,
                    const std::map<std::string, std::string>& metadata = {});

}  // namespace sbp
