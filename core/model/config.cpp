#include "core/model/config.h"

#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <type_traits>

#include <nlohmann/json.hpp>
#include "core/io/input_error.h"

namespace sbp {
namespace {

// The real Qwen3 dense models share vocabulary, head_dim, KV heads, rope_theta and eps; only these differ.
ModelConfig qwen3(const std::string& name, std::int64_t d, std::int64_t inter, std::int64_t layers, std::int64_t heads,
                  bool tied) {
  ModelConfig c;
  c.name = name;
  c.vocab_size = 151936;
  c.hidden_size = d;
  c.intermediate_size = inter;
  c.num_hidden_layers = layers;
  c.num_attention_heads = heads;
  c.num_key_value_heads = 8;
  c.head_dim = 128;
  c.tie_word_embeddings = tied;
  return c;
}

ModelConfig tiny() {
  ModelConfig c;
  c.name = "tiny";
  c.vocab_size = 512;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  return c;
}

// CPU-sized, but with the real vocabulary: at long T the logits are half of the memory story.
ModelConfig qwen3_small() {
  ModelConfig c = qwen3("qwen3-small", 512, 1536, 8, 8, true);
  c.num_key_value_heads = 4;
  c.head_dim = 64;
  return c;
}

// Llama-3.1-8B's shape (meta-llama/Llama-3.1-8B config.json), for the projections beside ALST, which trains it: no q/k
// norm, no biases, an untied head, rope_theta 5e5. Its RoPE is applied without the llama3 frequency scaling, which
// changes no byte and no FLOP but the function past the original 8K positions: a random-weight model of this shape,
// not a checkpoint of it (config.json refuses rope_scaling).
ModelConfig llama31_8b() {
  ModelConfig c;
  c.name = "llama-3.1-8b";
  c.vocab_size = 128256;
  c.hidden_size = 4096;
  c.intermediate_size = 14336;
  c.num_hidden_layers = 32;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 8;
  c.head_dim = 128;
  c.max_position_embeddings = 131072;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 5e5;
  c.qk_norm = false;
  c.tie_word_embeddings = false;
  return c;
}

// Multi-head twins (as many K/V heads as query heads) of the two CPU presets: the memory models' MHA grid points.
ModelConfig with_mha(ModelConfig c, const std::string& name) {
  c.name = name;
  c.num_key_value_heads = c.num_attention_heads;
  return c;
}

const std::map<std::string, ModelConfig (*)()>& presets() {
  static const std::map<std::string, ModelConfig (*)()> table = {
      {"tiny", tiny},
      {"tiny-mha", [] { return with_mha(tiny(), "tiny-mha"); }},
      {"qwen3-small", qwen3_small},
      {"qwen3-small-mha", [] { return with_mha(qwen3_small(), "qwen3-small-mha"); }},
      {"qwen3-0.6b", [] { return qwen3("qwen3-0.6b", 1024, 3072, 28, 16, true); }},
      {"qwen3-1.7b", [] { return qwen3("qwen3-1.7b", 2048, 6144, 28, 16, true); }},
      {"qwen3-4b", [] { return qwen3("qwen3-4b", 2560, 9728, 36, 32, true); }},
      {"qwen3-8b", [] { return qwen3("qwen3-8b", 4096, 12288, 36, 32, false); }},
      {"qwen3-14b", [] { return qwen3("qwen3-14b", 5120, 17408, 40, 40, false); }},
      {"qwen3-32b", [] { return qwen3("qwen3-32b", 5120, 25600, 64, 64, false); }},
      {"llama-3.1-8b", llama31_8b},
  };
  return table;
}

void require(bool ok, const std::string& what) {
  if (!ok) throw InputError("invalid model config: " + what);
}

}  // namespace

std::int64_t ModelConfig::num_parameters() const {
  const std::int64_t d = hidden_size;
  std::int64_t attn = d * q_width() + 2 * d * kv_width() + q_width() * d;
  if (attention_bias) attn += q_width() + 2 * kv_width();
  if (o_proj_bias) attn += d;
  if (qk_norm) attn += 2 * head_dim;
  const std::int64_t layer = attn + 3 * d * intermediate_size + 2 * d;
  const std::int64_t embeddings = vocab_size * d * (tie_word_embeddings ? 1 : 2);
  return num_hidden_layers * layer + embeddings + d;
}

void ModelConfig::validate() const {
  require(vocab_size > 0, "vocab_size must be > 0");
  require(hidden_size > 0, "hidden_size must be > 0");
  require(intermediate_size > 0, "intermediate_size must be > 0");
  require(num_hidden_layers > 0, "num_hidden_layers must be > 0");
  require(num_attention_heads > 0, "num_attention_heads must be > 0");
  require(num_key_value_heads > 0, "num_key_value_heads must be > 0");
  require(num_attention_heads % num_key_value_heads == 0,
          "num_attention_heads (" + std::to_string(num_attention_heads) + ") must be a multiple of num_key_value_heads (" +
              std::to_string(num_key_value_heads) + ")");
  require(head_dim > 0 && head_dim % 2 == 0, "head_dim must be a positive even number (RoPE rotates halves)");
  require(rms_norm_eps > 0, "rms_norm_eps must be > 0");
  require(rope_theta > 0, "rope_theta must be > 0");
  require(max_position_embeddings > 0, "max_position_embeddings must be > 0");
  // Counts of a bigger model overflow int64 (num_parameters and every byte count after it); none is near.
  const long double d = hidden_size, q = static_cast<long double>(num_attention_heads) * head_dim,
                    kv = static_cast<long double>(num_key_value_heads) * head_dim, per_layer = d * (2 * q + 2 * kv) +
                        3 * d * intermediate_size + 2 * q + 2 * kv + 2 * head_dim + 3 * d;
  require(num_hidden_layers * per_layer + 2 * d * vocab_size + d < 0x1p62L,
          "the sizes describe more than 2^62 parameters");
}

ModelConfig preset_config(const std::string& name) {
  auto it = presets().find(name);
  if (it == presets().end()) {
    std::string known;
    for (const auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
    throw InputError("unknown preset '" + name + "' (known: " + known + ")");
  }
  return it->second();
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& [n, f] : presets()) names.push_back(n);
  return names;
}

ModelConfig read_config_json(const std::filesystem::path& file) {
  std::ifstream in(file);
  if (!in) throw InputError(file.string() + ": cannot open config");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(file.string() + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw InputError(file.string() + ": config must be a JSON object");
  auto field = [&](const char* key, auto& out, bool required) {
    if (!j.contains(key) || j[key].is_null()) {
      if (required) throw InputError(file.string() + ": missing required field '" + key + "'");
      return;
    }
    // The JSON type must be the field's: nlohmann would convert 1e300 to an integer field (undefined behaviour) and
    // 1.5 to 1 without a word.
    using T = std::decay_t<decltype(out)>;
    const auto& v = j.at(key);
    bool ok = v.is_string();
    if constexpr (std::is_same_v<T, bool>) ok = v.is_boolean();
    else if constexpr (std::is_integral_v<T>) ok = v.is_number_integer();
    else if constexpr (std::is_floating_point_v<T>) ok = v.is_number();
    if (!ok) throw InputError(file.string() + ": field '" + key + "' has the wrong type (" + v.dump() + ")");
    v.get_to(out);
  };
  ModelConfig c;
  c.name = file.parent_path().filename().string();
  std::string model_type = "qwen3";
  field("model_type", model_type, false);
  if (model_type != "qwen3" && model_type != "qwen2" && model_type != "llama")
    throw InputError(file.string() + ": unsupported model_type '" + model_type + "' (qwen3, qwen2, llama)");
  c.qk_norm = model_type == "qwen3";
  c.attention_bias = model_type == "qwen2";
  field("vocab_size", c.vocab_size, true);
  field("hidden_size", c.hidden_size, true);
  field("intermediate_size", c.intermediate_size, true);
  field("num_hidden_layers", c.num_hidden_layers, true);
  field("num_attention_heads", c.num_attention_heads, true);
  c.num_key_value_heads = c.num_attention_heads;
  field("num_key_value_heads", c.num_key_value_heads, false);
  c.head_dim = c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0;
  field("head_dim", c.head_dim, false);
  field("max_position_embeddings", c.max_position_embeddings, false);
  field("rms_norm_eps", c.rms_norm_eps, false);
  field("rope_theta", c.rope_theta, false);
  field("tie_word_embeddings", c.tie_word_embeddings, false);
  field("qk_norm", c.qk_norm, false);
  field("attention_bias", c.attention_bias, false);
  // Qwen2 has q/k/v bias but no o_proj bias; Qwen3 and Llama put attention_bias on o_proj too.
  c.o_proj_bias = model_type != "qwen2" && c.attention_bias;
  field("o_proj_bias", c.o_proj_bias, false);
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null())
    throw InputError(file.string() + ": rope_scaling is not supported (absolute-position RoPE only)");
  bool sliding_window = false;
  field("use_sliding_window", sliding_window, false);
  if (sliding_window)
    throw InputError(file.string() + ": use_sliding_window is not supported (full causal attention only)");
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    throw InputError(file.string() + ": " + e.what());
  }
  return c;
}

std::string read_config_dtype(const std::filesystem::path& file) {
  std::ifstream in(file);
  if (!in) throw InputError(file.string() + ": cannot open config");
  const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) throw InputError(file.string() + ": not a JSON object");
  const auto it = j.find("torch_dtype");
  if (it == j.end() || it->is_null()) return "float32";
  if (!it->is_string()) throw InputError(file.string() + ": field 'torch_dtype' must be a string");
  return it->get<std::string>();
}

std::string config_to_json(const ModelConfig& c, const std::string& torch_dtype) {
  std::string model_type = "qwen3", arch = "Qwen3ForCausalLM";
  if (!c.qk_norm && c.attention_bias && !c.o_proj_bias) model_type = "qwen2", arch = "Qwen2ForCausalLM";
  if (!c.qk_norm && !c.attention_bias) model_type = "llama", arch = "LlamaForCausalLM";
  nlohmann::ordered_json j;
  j["architectures"] = {arch};
  j["model_type"] = model_type;
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["rope_scaling"] = nullptr;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["attention_bias"] = c.attention_bias;
  j["qk_norm"] = c.qk_norm;
  j["o_proj_bias"] = c.o_proj_bias;
  j["torch_dtype"] = torch_dtype;
  return j.dump(2) + "\n";
}

}  // namespace sbp
