// The memory part of the JSON records of run and train: one writer, so that the same thing has one name and one shape
// in every record (maxlen's CSV columns use the same names: model_peak_bytes, host_peak_bytes, model_host_bytes).
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/methods/memory_model.h"

namespace sbp {

class OffloadTier;

// [{"name": ..., "bytes": ...}, ...] in the estimate's order.
nlohmann::json terms_json(const std::vector<MemoryTerm>& terms);

// model_peak_bytes, model_peak_moment, model_terms (null without an estimate: a run that took no step), offload (the
// kinds, as --offload describes them), host_peak_bytes (the tier's measured peak) and model_host_bytes (null without
// a tier).
nlohmann::json memory_record(const MemoryEstimate* estimate, const std::string& offload, const OffloadTier* tier);

}  // namespace sbp
