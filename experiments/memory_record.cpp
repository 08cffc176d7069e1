#include "experiments/memory_record.h"

#include "core/offload/offload_tier.h"

namespace sbp {

nlohmann::json terms_json(const std::vector<MemoryTerm>& terms) {
  auto out = nlohmann::json::array();
  for (const auto& t : terms) out.push_back({{"name", t.name}, {"bytes", t.bytes}});
  return out;
}

nlohmann::json memory_record(const MemoryEstimate* estimate, const std::string& offload, const OffloadTier* tier) {
  const auto unless = [](bool have, nlohmann::json value) { return have ? value : nlohmann::json(); };
  return {{"model_peak_bytes", unless(estimate, estimate ? estimate->total_bytes() : 0)},
          {"model_peak_moment", unless(estimate, estimate ? estimate->moment : "")},
          {"model_terms", unless(estimate, estimate ? terms_json(estimate->terms) : nlohmann::json())},
          {"offload", offload},
          {"host_peak_bytes", unless(tier, tier ? tier->peak_bytes() : 0)},
          {"model_host_bytes", unless(tier && estimate, tier && estimate ? estimate->host_bytes() : 0)}};
}

}  // namespace sbp
