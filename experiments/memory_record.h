// The memory model's terms as the JSON records of run and train write them (`model_terms`, `model_host_terms`): one
// writer, so that the same thing has one name and one shape in every record.
#pragma once

#include <vector>

#include <nlohmann/json.hpp>

#include "core/methods/memory_model.h"

namespace sbp {

// [{"name": ..., "bytes": ...}, ...] in the estimate's order.
nlohmann::json terms_json(const std::vector<MemoryTerm>& terms);

}  // namespace sbp
