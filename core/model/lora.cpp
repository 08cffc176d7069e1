#include "core/model/lora.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <regex>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include "core/io/input_error.h"

namespace sbp {

const std::vector<std::string>& lora_target_names() {
  static const std::vector<std::string> names = {"q", "k", "v", "o", "gate", "up", "down"};
  return names;
}

std::string lora_module_name(const std::string& target) { return target + "_proj"; }

std::string lora_target_of_module(const std::string& module, const std::string& source) {
  auto name = module;
  if (name.size() > 5 && name.compare(name.size() - 5, 5, "_proj") == 0) name = name.substr(0, name.size() - 5);
  const auto& known = lora_target_names();
  if (std::find(known.begin(), known.end(), name) == known.end())
    throw InputError(source + ": unknown LoRA target '" + module +
                                "' (known: all-linear or q, k, v, o, gate, up, down, with or without _proj)");
  return name;
}

std::string lora_tensor_name(std::int64_t layer, const std::string& target, const std::string& which) {
  const bool attention = target == "q" || target == "k" || target == "v" || target == "o";
  return "base_model.model.model.layers." + std::to_string(layer) + (attention ? ".self_attn." : ".mlp.") +
         lora_module_name(target) + ".lora_" + which + ".weight";
}

std::string LoraConfig::spec() const {
  std::string list;
  for (const auto& t : lora_target_names())
    if (targets.count(t)) list += (list.empty() ? "" : ",") + t;
  return fmt::format("rank={},alpha={},targets={},init={}", rank, alpha, list, init);
}

LoraConfig parse_lora_spec(const std::string& text) {
  LoraConfig c;
  const std::string where = "--lora " + text;
  std::string key;  // the key a bare item (no '=') belongs to: only targets takes a list
  std::stringstream in(text);
  std::string item;
  bool alpha_given = false;
  auto number = [&](const std::string& k, const std::string& v) {
    std::size_t used = 0;
    double x = 0;
    try {
      x = std::stod(v, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != v.size() || !(x > 0)) throw InputError(where + ": " + k + "=" + v + " must be a number > 0");
    return x;
  };
  while (std::getline(in, item, ',')) {
    const auto eq = item.find('=');
    std::string value;
    if (eq == std::string::npos) {
      if (key != "targets") throw InputError(where + ": expected key=value, got '" + item + "'");
      value = item;
    } else {
      key = item.substr(0, eq);
      value = item.substr(eq + 1);
    }
    if (key == "rank") {
      const double r = number(key, value);
      // Range first: converting a double beyond int64 is undefined behaviour (the spec fuzzer's rank=9.2e19).
      if (r > double(std::int64_t{1} << 53) || r != std::floor(r))
        throw InputError(where + ": rank=" + value + " must be an integer in [1, 2^53]");
      c.rank = std::int64_t(r);
    } else if (key == "alpha") {
      c.alpha = number(key, value);
      alpha_given = true;
    } else if (key == "targets") {
      if (value == "all-linear")
        c.targets.insert(lora_target_names().begin(), lora_target_names().end());
      else
        c.targets.insert(lora_target_of_module(value, where));
    } else if (key == "init") {
      if (value != "peft" && value != "random")
        throw InputError(where + ": init=" + value + " must be peft or random");
      c.init = value;
    } else {
      throw InputError(where + ": unknown option '" + key + "' (known: rank, alpha, targets, init)");
    }
  }
  if (c.rank <= 0) throw InputError(where + ": needs rank=R with R > 0");
  if (!alpha_given) c.alpha = 2.0 * double(c.rank);
  if (c.targets.empty()) c.targets.insert(lora_target_names().begin(), lora_target_names().end());
  return c;
}

LoraConfig read_adapter_config(const std::filesystem::path& file) {
  std::ifstream in(file);
  if (!in) throw InputError(file.string() + ": cannot read (a PEFT adapter folder has adapter_config.json)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw InputError(file.string() + ": not JSON: " + e.what());
  }
  auto fail = [&](const std::string& what) { throw InputError(file.string() + ": " + what); };
  auto get = [&](const char* key) -> const nlohmann::json& {
    if (!j.contains(key)) fail(std::string("missing key '") + key + "'");
    return j.at(key);
  };
  if (get("peft_type") != "LORA") fail("peft_type " + get("peft_type").dump() + ": only LORA adapters are supported");
  LoraConfig c;
  if (!get("r").is_number_integer() || get("r").get<std::int64_t>() <= 0) fail("key 'r' must be an integer > 0");
  c.rank = get("r").get<std::int64_t>();
  if (!get("lora_alpha").is_number() || get("lora_alpha").get<double>() <= 0) fail("key 'lora_alpha' must be > 0");
  c.alpha = get("lora_alpha").get<double>();
  // PEFT's matching rule (check_target_module_exists): a list entry matches a module whose name equals it or ends
  // with "." + entry; a string other than "all-linear" is a regular expression over the whole module name. PEFT
  // saves "all-linear" expanded, as full module paths when there are few (model.layers.0.self_attn.q_proj, ...).
  // Each entry maps to the target whose projection it names; an adapter that covers only some layers then fails
  // load_lora's tensor check, naming the first missing tensor.
  const auto& modules = get("target_modules");
  if (modules.is_string() && modules == "all-linear") {
    c.targets.insert(lora_target_names().begin(), lora_target_names().end());
  } else if (modules.is_string()) {
    std::regex pattern;
    try {
      pattern = std::regex(modules.get<std::string>());
    } catch (const std::regex_error&) {
      fail("key 'target_modules' is not a valid regular expression: " + modules.dump());
    }
    for (const auto& t : lora_target_names()) {
      const bool attention = t == "q" || t == "k" || t == "v" || t == "o";
      const auto module = std::string("model.layers.0.") + (attention ? "self_attn." : "mlp.") + lora_module_name(t);
      if (std::regex_match(module, pattern)) c.targets.insert(t);
    }
    if (c.targets.empty()) fail("key 'target_modules' " + modules.dump() + " matches none of the seven projections");
  } else if (modules.is_array()) {
    for (const auto& m : modules) {
      if (!m.is_string()) fail("key 'target_modules' holds a non-string entry " + m.dump());
      auto name = m.get<std::string>();
      name = name.substr(name.rfind('.') == std::string::npos ? 0 : name.rfind('.') + 1);  // the last component
      c.targets.insert(lora_target_of_module(name, file.string() + ": key 'target_modules'"));
    }
  } else {
    fail("key 'target_modules' must be a list or a string");
  }
  // init_lora_weights only says how PEFT drew the weights; what is loaded is what the file holds.
  c.init = "loaded";
  // Options that change the function: refuse rather than compute something else.
  auto require = [&](const char* key, const nlohmann::json& expected) {
    if (j.contains(key) && !j.at(key).is_null() && j.at(key) != expected)
      fail(std::string("key '") + key + "' is " + j.at(key).dump() + "; only " + expected.dump() + " is supported");
  };
  require("fan_in_fan_out", false);
  require("use_rslora", false);
  require("use_dora", false);
  require("bias", "none");
  if (j.contains("modules_to_save") && !j.at("modules_to_save").is_null() && !j.at("modules_to_save").empty())
    fail("key 'modules_to_save' is " + j.at("modules_to_save").dump() + "; fully trained extra modules are not supported");
  if (j.contains("layers_to_transform") && !j.at("layers_to_transform").is_null())
    fail("key 'layers_to_transform' is set; adapters on a subset of layers are not supported");
  for (const char* key : {"rank_pattern", "alpha_pattern"})
    if (j.contains(key) && !j.at(key).is_null() && !j.at(key).empty())
      fail(std::string("key '") + key + "' is set; per-module ranks are not supported");
  return c;
}

std::string adapter_config_json(const LoraConfig& c, const std::string& base_model) {
  nlohmann::json modules = nlohmann::json::array();
  for (const auto& t : lora_target_names())
    if (c.targets.count(t)) modules.push_back(lora_module_name(t));
  const nlohmann::json j = {{"peft_type", "LORA"},
                            {"task_type", "CAUSAL_LM"},
                            {"base_model_name_or_path", base_model},
                            {"r", c.rank},
                            {"lora_alpha", c.alpha},
                            {"lora_dropout", 0.0},
                            {"target_modules", modules},
                            {"bias", "none"},
                            {"fan_in_fan_out", false},
                            {"use_rslora", false},
                            {"use_dora", false},
                            {"init_lora_weights", c.init == "peft"},  // false: the weights are what the file holds
                            {"modules_to_save", nullptr},
                            {"inference_mode", false}};
  return j.dump(2) + "\n";
}

}  // namespace sbp
