// Method and objective specs: "name" or "name:key=value,key=value" (e.g. "streambp:layer_chunk=512,head_chunk=128",
// "grpo:beta=0.04,loss_type=bnpo").
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>
#include "core/io/input_error.h"

namespace sbp {

struct Spec {
  std::string kind = "method";  // "method" or "objective": what error messages call it
  std::string name;
  std::map<std::string, std::string> options;

  // Throws InputError naming the spec and the key when a key is not in `known`.
  void check_keys(const std::set<std::string>& known) const;
  std::int64_t get_int(const std::string& key, std::int64_t fallback, std::int64_t min_value) const;
  // A finite number in [min_value, max_value].
  double get_double(const std::string& key, double fallback, double min_value, double max_value) const;
  // One of `choices`.
  std::string get_choice(const std::string& key, const std::string& fallback, const std::set<std::string>& choices) const;
};

Spec parse_spec(const std::string& text, const std::string& kind = "method");  // throws on malformed text

// The name in `names` nearest to a mistyped `word`, at most two edits away (a "did you mean" suggestion); empty when
// none is that close.
std::string nearest_name(const std::string& word, const std::vector<std::string>& names);

}  // namespace sbp
