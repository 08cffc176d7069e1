#include "baselines/methods.h"

#include <set>
#include <stdexcept>

#include "baselines/checkpoint.h"
#include "baselines/mst.h"
#include "baselines/standard.h"
#include "core/methods/streambp.h"
#include "core/io/input_error.h"

namespace sbp {

namespace {

// The built-in methods, one line each; their order is the help's.
const std::vector<MethodEntry>& builtin() {
  static const std::vector<MethodEntry> entries = {
      standard_entry(),
      checkpoint_entry(),
      mst_entry(),
      streambp_entry(),
  };
  return entries;
}

std::vector<MethodEntry>& registered() {
  static std::vector<MethodEntry> entries;
  return entries;
}

const MethodEntry* find(const std::string& name) {
  for (const auto& e : builtin())
    if (e.name == name) return &e;
  for (const auto& e : registered())
    if (e.name == name) return &e;
  return nullptr;
}

}  // namespace

const std::vector<MethodEntry>& builtin_method_entries() { return builtin(); }

std::vector<MethodEntry> method_entries() {
  auto out = builtin();
  out.insert(out.end(), registered().begin(), registered().end());
  return out;
}

std::vector<std::string> method_names() {
  std::vector<std::string> names;
  for (const auto& e : method_entries()) names.push_back(e.name);
  return names;
}

std::string methods_usage() {
  std::string out;
  for (const auto& e : builtin()) out += (out.empty() ? "" : " | ") + e.usage();
  return out;
}

void register_method(MethodEntry entry) {
  for (const auto& e : builtin())
    if (e.name == entry.name) throw InputError("register_method: '" + entry.name + "' is a built-in method");
  for (auto& e : registered())
    if (e.name == entry.name) {  // registered again: the newer entry replaces it
      e = std::move(entry);
      return;
    }
  registered().push_back(std::move(entry));
}

void register_method(const std::string& name, MethodFactory factory) {
  MethodEntry e;
  e.name = name;
  e.summary = "registered at run time";
  e.reads_spec_itself = true;
  e.make = [factory = std::move(factory)](const MethodArgs& a) { return factory(a.spec()); };
  register_method(std::move(e));
}

std::unique_ptr<BackpropMethod> make_method(const std::string& text) {
  const Spec spec = parse_spec(text);
  const MethodEntry* entry = find(spec.name);
  if (!entry) {
    std::string known;
    for (const auto& n : method_names()) known += (known.empty() ? "" : ", ") + n;
    throw InputError("unknown method '" + spec.name + "' (known: " + known + ")");
  }
  // Declared options are checked here, each value against its minimum; a factory registered from its spec alone
  // (no declared options) checks its own keys.
  if (!entry->reads_spec_itself) {
    std::set<std::string> keys;
    for (const auto& o : entry->options) keys.insert(o.key);
    spec.check_keys(keys);
  }
  const MethodArgs args(spec, entry->options);
  for (const auto& o : entry->options) args.get(o.key);  // every given value within bounds before the build
  return entry->make(args);
}

std::vector<std::string> edge_method_specs(std::int64_t T) {
  std::vector<std::string> out;
  for (const auto& e : builtin())
    for (const auto& s : e.tests.edges(T)) out.push_back(s);
  return out;
}

std::vector<std::string> typical_method_specs(std::int64_t T) {
  std::vector<std::string> out;
  for (const auto& e : builtin()) out.push_back(e.tests.typical(T));
  return out;
}

std::vector<std::string> metered_method_specs() {
  std::vector<std::string> out;
  for (const auto& e : builtin()) {
    if (e.tests.metered.empty()) out.push_back(e.name);
    for (const auto& s : e.tests.metered) out.push_back(s);
  }
  return out;
}

}  // namespace sbp
