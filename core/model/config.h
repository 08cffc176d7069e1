// Model configuration of a Qwen3-family dense decoder: named presets and HF config.json in/out.
#pragma once

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>
#include "core/io/input_error.h"

namespace sbp {

struct ModelConfig {
  std::string name = "custom";  // preset name, or where the config came from
  std::int64_t vocab_size = 0;
  std::int64_t hidden_size = 0;        // d
  std::int64_t intermediate_size = 0;  // MLP width
  std::int64_t num_hidden_layers = 0;  // L
  std::int64_t num_attention_heads = 0;
  std::int64_t num_key_value_heads = 0;  // < num_attention_heads: grouped-query attention
  std::int64_t head_dim = 0;
  std::int64_t max_position_embeddings = 40960;
  double rms_norm_eps = 1e-6;
  double rope_theta = 1e6;
  bool qk_norm = true;               // Qwen3: per-head RMSNorm on q and k before RoPE
  bool attention_bias = false;       // bias on q/k/v projections (Qwen2)
  bool o_proj_bias = false;          // bias on o_proj (Qwen3/Llama with attention_bias; never Qwen2)
  bool tie_word_embeddings = true;   // lm_head shares the embedding matrix

  std::int64_t q_width() const { return num_attention_heads * head_dim; }
  std::int64_t kv_width() const { return num_key_value_heads * head_dim; }
  // Attention's softmax scale, 1/sqrt(head_dim) (Qwen3 and Llama have no other).
  double attention_scale() const { return 1.0 / std::sqrt(double(head_dim)); }
  std::int64_t num_parameters() const;
  // Throws InputError naming the offending field.
  void validate() const;
};

ModelConfig preset_config(const std::string& name);  // throws, listing the known names
std::vector<std::string> preset_names();

// HF config.json (model_type qwen3, qwen2 or llama; explicit qk_norm / attention_bias keys win over model_type).
ModelConfig read_config_json(const std::filesystem::path& file);
// The config's torch_dtype ("float32" if absent): the dtype a checkpoint was saved in.
std::string read_config_dtype(const std::filesystem::path& file);
std::string config_to_json(const ModelConfig& config, const std::string& torch_dtype);

}  // namespace sbp
