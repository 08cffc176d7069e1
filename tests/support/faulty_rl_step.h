// Faulty stages of the whole-RL-step oracle (verify/rl_step_oracle.h), one known bug per stage of a GRPO trainer's
// step, for the negative controls of docs/rl-steps.md: each must make rl_step_differences fail, naming a tensor.
// The oracle carries no switch for any of them: each replaces one of its stages.
#pragma once

#include "verify/rl_step_oracle.h"

namespace sbp::test {

// Prompts left-padded to the longest one and the pads attended (the attention mask ignored): every log-prob moves.
RlStepStages pads_attended_stages();
// The EOS mask off by one: the first EOS itself left unscored.
RlStepStages eos_mask_off_by_one_stages();
// Advantages normalised over the wrong set: the whole generation batch's mean and std instead of the group's.
RlStepStages batch_normalised_advantages_stages();
// dapo's normaliser taken per micro-batch (its own tokens x the accumulation steps) instead of over the generation
// batch: right only when every micro-batch holds as many completion tokens.
RlStepStages per_micro_batch_normaliser_stages();
// old_logps from the wrong pass: the current weights' (detached) instead of generation time's. Right at the first
// optimizer step, wrong after an update.
RlStepStages old_logps_from_current_pass_stages();

}  // namespace sbp::test
