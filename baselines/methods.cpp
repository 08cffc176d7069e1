#include "baselines/methods.h"

#include <map>
#include <stdexcept>

#include "baselines/checkpoint.h"
#include "baselines/mst.h"
#include "baselines/standard.h"
#include "core/io/spec.h"
#include "core/methods/streambp.h"

namespace sbp {

namespace {

std::map<std::string, MethodFactory>& registered() {
  static std::map<std::string, MethodFactory> methods;
  return methods;
}

}  // namespace

std::vector<std::string> method_names() {
  std::vector<std::string> names = {"standard", "checkpoint", "mst", "streambp"};
  for (const auto& [name, factory] : registered()) names.push_back(name);
  return names;
}

void register_method(const std::string& name, MethodFactory factory) {
  for (const std::string builtin : {"standard", "checkpoint", "mst", "streambp"})
    if (name == builtin) throw std::invalid_argument("register_method: '" + name + "' is a built-in method");
  registered()[name] = std::move(factory);
}

std::unique_ptr<BackpropMethod> make_method(const std::string& text) {
  const Spec spec = parse_spec(text);
  if (spec.name == "standard") {
    spec.check_keys({});
    return std::make_unique<StandardBackprop>();
  }
  if (spec.name == "checkpoint") {
    spec.check_keys({});
    return std::make_unique<CheckpointBackprop>();
  }
  if (spec.name == "mst") {
    spec.check_keys({"mini_seq"});
    MsT::Options o;
    o.mini_seq = spec.get_int("mini_seq", o.mini_seq, 1);
    return std::make_unique<MsT>(o);
  }
  if (spec.name == "streambp") {
    spec.check_keys({"layer_chunk", "head_chunk"});
    StreamBP::Options o;
    o.layer_chunk = spec.get_int("layer_chunk", o.layer_chunk, 1);
    o.head_chunk = spec.get_int("head_chunk", o.head_chunk, 1);
    return std::make_unique<StreamBP>(o);
  }
  if (const auto it = registered().find(spec.name); it != registered().end()) return it->second(spec);
  std::string known;
  for (const auto& n : method_names()) known += (known.empty() ? "" : ", ") + n;
  throw std::invalid_argument("unknown method '" + spec.name + "' (known: " + known + ")");
}

}  // namespace sbp
