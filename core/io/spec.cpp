#include "core/io/spec.h"

#include <cmath>
#include <sstream>
#include <stdexcept>

namespace sbp {
namespace {

std::string join(const std::set<std::string>& items) {
  std::string list;
  for (const auto& k : items) list += (list.empty() ? "" : ", ") + k;
  return list;
}

}  // namespace

Spec parse_spec(const std::string& text, const std::string& kind) {
  Spec spec;
  spec.kind = kind;
  const auto colon = text.find(':');
  spec.name = text.substr(0, colon);
  if (spec.name.empty()) throw std::invalid_argument(kind + " spec '" + text + "' has no " + kind + " name");
  if (colon == std::string::npos) return spec;
  std::stringstream rest(text.substr(colon + 1));
  std::string item;
  while (std::getline(rest, item, ',')) {
    const auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size())
      throw std::invalid_argument(kind + " spec '" + text + "': expected key=value, got '" + item + "'");
    if (!spec.options.emplace(item.substr(0, eq), item.substr(eq + 1)).second)
      throw std::invalid_argument(kind + " spec '" + text + "': key '" + item.substr(0, eq) + "' given twice");
  }
  return spec;
}

void Spec::check_keys(const std::set<std::string>& known) const {
  for (const auto& [key, value] : options)
    if (!known.count(key))
      throw std::invalid_argument(kind + " '" + name + "': unknown option '" + key + "'" +
                                  (known.empty() ? " (it takes none)" : " (known: " + join(known) + ")"));
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
    throw std::invalid_argument(kind + " '" + name + "': option " + key + "=" + it->second + " must be an integer >= " +
                                std::to_string(min_value));
  return value;
}

double Spec::get_double(const std::string& key, double fallback, double min_value, double max_value) const {
  auto it = options.find(key);
  if (it == options.end()) return fallback;
  std::size_t used = 0;
  double value = 0;
  try {
    value = std::stod(it->second, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != it->second.size() || !std::isfinite(value) || value < min_value || value > max_value) {
    std::ostringstream range;
    range << "[" << min_value << ", " << max_value << "]";
    throw std::invalid_argument(kind + " '" + name + "': option " + key + "=" + it->second + " must be a number in " +
                                range.str());
  }
  return value;
}

std::string Spec::get_choice(const std::string& key, const std::string& fallback,
                             const std::set<std::string>& choices) const {
  auto it = options.find(key);
  if (it == options.end()) return fallback;
  if (!choices.count(it->second))
    throw std::invalid_argument(kind + " '" + name + "': option " + key + "=" + it->second + " must be one of " +
                                join(choices));
  return it->second;
}

}  // namespace sbp
