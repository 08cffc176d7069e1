#include "core/io/spec.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>
#include "core/io/input_error.h"

namespace sbp {
namespace {

std::string join(const std::set<std::string>& items) {
  std::string list;
  for (const auto& k : items) list += (list.empty() ? "" : ", ") + k;
  return list;
}

// Edit distance of two short words.
std::size_t distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const auto above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

}  // namespace

std::string nearest_name(const std::string& word, const std::vector<std::string>& names) {
  std::string nearest;
  std::size_t best = 3;  // at most two edits away, or no suggestion
  for (const auto& name : names)
    if (const auto d = distance(word, name); d < best) best = d, nearest = name;
  return nearest;
}

Spec parse_spec(const std::string& text, const std::string& kind) {
  Spec spec;
  spec.kind = kind;
  const auto colon = text.find(':');
  spec.name = text.substr(0, colon);
  if (spec.name.empty()) throw InputError(kind + " spec '" + text + "' has no " + kind + " name");
  if (colon == std::string::npos) return spec;
  std::stringstream rest(text.substr(colon + 1));
  std::string item;
  while (std::getline(rest, item, ',')) {
    const auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size())
      throw InputError(kind + " spec '" + text + "': expected key=value, got '" + item + "'");
    if (!spec.options.emplace(item.substr(0, eq), item.substr(eq + 1)).second)
      throw InputError(kind + " spec '" + text + "': key '" + item.substr(0, eq) + "' given twice");
  }
  return spec;
}

void Spec::check_keys(const std::set<std::string>& known) const {
  for (const auto& [key, value] : options)
    if (!known.count(key))
      throw InputError(kind + " '" + name + "': unknown option '" + key + "'" +
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
    throw InputError(kind + " '" + name + "': option " + key + "=" + it->second + " must be an integer >= " +
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
    throw InputError(kind + " '" + name + "': option " + key + "=" + it->second + " must be a number in " +
                                range.str());
  }
  return value;
}

std::string Spec::get_choice(const std::string& key, const std::string& fallback,
                             const std::set<std::string>& choices) const {
  auto it = options.find(key);
  if (it == options.end()) return fallback;
  if (!choices.count(it->second))
    throw InputError(kind + " '" + name + "': option " + key + "=" + it->second + " must be one of " +
                                join(choices));
  return it->second;
}

}  // namespace sbp
