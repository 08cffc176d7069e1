// Method specs: "name" or "name:key=value,key=value" (e.g. "streambp:layer_chunk=512,head_chunk=128").
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>

namespace sbp {

struct Spec {
  std::string name;
  std::map<std::string, std::string> options;

  // Throws std::invalid_argument naming the spec and the key when a key is not in `known`.
  void check_keys(const std::set<std::string>& known) const;
  std::int64_t get_int(const std::string& key, std::int64_t fallback, std::int64_t min_value) const;
};

Spec parse_spec(const std::string& text);  // throws std::invalid_argument on malformed text

}  // namespace sbp
