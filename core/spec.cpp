#include "core/spec.h"

#include <sstream>
#include <stdexcept>

namespace sbp {

Spec parse_spec(const std::string& text) {
  Spec spec;
  const auto colon = text.find(':');
  spec.name = text.substr(0, colon);
  if (spec.name.empty()) throw std::invalid_argument("method spec '" + text + "' has no method name");
  if (colon == std::string::npos) return spec;
  std::stringstream rest(text.substr(colon + 1));
  std::string item;
  while (std::getline(rest, item, ',')) {
    const auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size())
      throw std::invalid_argument("method spec '" + text + "': expected key=value, got '" + item + "'");
    if (!spec.options.emplace(item.substr(0, eq), item.substr(eq + 1)).second)
      throw std::invalid_argument("method spec '" + text + "': key '" + item.substr(0, eq) + "' given twice");
  }
  return spec;
}

void Spec::check_keys(const std::set<std::string>& known) const {
  for (const auto& [key, value] : options)
    if (!known.count(key)) {
      std::string list;
      for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
      throw std::invalid_argument("method '" + name + "': unknown option '" + key + "'" +
                                  (list.empty() ? " (it takes none)" : " (known: " + list + ")"));
    }
}

std::int64_t Spec::get_int(const std::string& key, std::int64_t fallback, std::int64_t min_value) const {
  auto it = options.find(key);
  if (it == options.end()) return fallback;
  std::size_t used = 0;
  std::int64_t value = 0;
  try {
    value = std::stoll(it->second, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != it->second.size() || value < min_value)
    throw std::invalid_argument("method '" + name + "': option " + key + "=" + it->second + " must be an integer >= " +
                                std::to_string(min_value));
  return value;
}

}  // namespace sbp
