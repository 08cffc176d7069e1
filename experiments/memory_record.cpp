#include "experiments/memory_record.h"

namespace sbp {

nlohmann::json terms_json(const std::vector<MemoryTerm>& terms) {
  auto out = nlohmann::json::array();
  for (const auto& t : terms) out.push_back({{"name", t.name}, {"bytes", t.bytes}});
  return out;
}

}  // namespace sbp
