#include "core/objectives/catalogue.h"

#include "core/objectives/dpo.h"
#include "core/objectives/grpo.h"
#include "core/objectives/sft.h"

namespace sbp {

std::string ObjectiveEntry::usage() const { return make(Spec{"objective", name, {}})->spec(); }

const std::vector<ObjectiveEntry>& objective_catalogue() {
  static const std::vector<ObjectiveEntry> entries = {
      {"sft", [](const Spec& s) -> std::unique_ptr<Objective> { return std::make_unique<SftObjective>(s); },
       {"sft"}},
      {"grpo", [](const Spec& s) -> std::unique_ptr<Objective> { return std::make_unique<GrpoObjective>(s); },
       {"grpo:beta=0.04,loss_type=grpo", "grpo:loss_type=dapo,importance=sequence"}},
      {"dpo", [](const Spec& s) -> std::unique_ptr<Objective> { return std::make_unique<DpoObjective>(s); },
       {"dpo:beta=0.1", "dpo:beta=0.1,label_smoothing=0.1"}},
  };
  return entries;
}

std::vector<std::string> objective_names() {
  std::vector<std::string> names;
  for (const auto& e : objective_catalogue()) names.push_back(e.name);
  return names;
}

std::string objectives_usage() {
  std::string out;
  for (const auto& e : objective_catalogue()) out += (out.empty() ? "" : " | ") + e.usage();
  return out;
}

std::vector<std::string> typical_objective_specs() {
  std::vector<std::string> specs;
  for (const auto& e : objective_catalogue()) specs.push_back(e.test_specs.front());
  return specs;
}

std::unique_ptr<Objective> make_objective(const std::string& text) {
  const Spec spec = parse_spec(text, "objective");
  for (const auto& e : objective_catalogue())
    if (spec.name == e.name) return e.make(spec);
  std::string known;
  for (const auto& name : objective_names()) known += (known.empty() ? "" : ", ") + name;
  throw InputError("unknown objective '" + spec.name + "' (known: " + known + ")");
}

}  // namespace sbp
