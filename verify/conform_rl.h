// conform's whole-RL-step cases (issue #60): the rl set, its case.json, and the judge of a trainer's returned step
// (the declarations of judge_rl_step and the case kind stay in conformance.h, beside the other judges).
#pragma once

#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/model/config.h"
#include "verify/conformance.h"
#include "verify/rl_step_oracle.h"

namespace sbp {

// The rl set: whole RL steps on one generation batch, each a TRL-named setting, on the model `config`.
std::vector<ConformCase> rl_cases(const ModelConfig& config);
// The rl set declared as verl 0.9.1 documents its actor update ("rl-verl": loss_agg_mode, its advantages' epsilon),
// each case named <rl case>-verl.
std::vector<ConformCase> rl_verl_cases(const ModelConfig& config);
// case.json's rl_step keys and returns for an rl_step case (`out` holds the batch case's keys already).
void add_rl_step_case_json(const ConformCase& c, nlohmann::json& out);

}  // namespace sbp
