// LoRA (Hu et al. 2021) as PEFT does it: y = W x + (alpha / r)·B(A x) on chosen projections, base weights frozen
// (no gradient buffers), only the adapters trained. Names and files follow PEFT, so adapters move between the two.
#pragma once

#include <cstdint>
#include <filesystem>
#include <set>
#include <string>
#include <vector>
#include "core/io/input_error.h"

namespace sbp {

// The projections LoRA can adapt, by short name: q, k, v, o (self_attn.*_proj), gate, up, down (mlp.*_proj).
const std::vector<std::string>& lora_target_names();

struct LoraConfig {
  std::int64_t rank = 0;  // 0: no LoRA
  double alpha = 0;       // PEFT's lora_alpha; the update is scaled by alpha / rank
  std::set<std::string> targets;
  // "peft": PEFT's default, A Kaiming-uniform (bound 1/sqrt(in)), B = 0 (the adapter starts as a no-op);
  // "random": A as PEFT, B ~ N(0, 0.02²), so that gradient checks see every path from the first step;
  // "loaded": the weights came from an adapter file.
  std::string init = "peft";

  bool enabled() const { return rank > 0; }
  double scaling() const { return alpha / double(rank); }
  std::string spec() const;  // "rank=32,alpha=64,targets=q,k,v,o,gate,up,down,init=peft"
};

// "--lora rank=R,alpha=A,targets=all-linear|q,k,...,init=peft|random": alpha defaults to 2·rank, targets to
// all-linear (the seven projections, not the LM head: PEFT's meaning). Throws InputError naming the key.
LoraConfig parse_lora_spec(const std::string& text);

// Elements of every adapter (A: [r, in], B: [out, r]) of `lora` on a model of `config`: from the shapes, not the
// tensors (which ZeRO-3 empties between uses).
struct ModelConfig;
std::int64_t lora_parameter_count(const ModelConfig& config, const LoraConfig& lora);

// PEFT's names: "base_model.model.model.layers.{layer}.self_attn.q_proj.lora_A.weight" etc.; `which` is "A" or "B".
std::string lora_tensor_name(std::int64_t layer, const std::string& target, const std::string& which);
// The HF module name of a target ("q" -> "q_proj"), and back (accepts both spellings; throws on others).
std::string lora_module_name(const std::string& target);
std::string lora_target_of_module(const std::string& module, const std::string& source);

// adapter_config.json in PEFT's format (peft_type LORA, r, lora_alpha, target_modules, ...). Reading throws naming the
// file and the key: another peft_type, fan_in_fan_out, rslora/DoRA, bias training or dropout-free assumptions unmet.
LoraConfig read_adapter_config(const std::filesystem::path& file);
std::string adapter_config_json(const LoraConfig& config, const std::string& base_model);

}  // namespace sbp
