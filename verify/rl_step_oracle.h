// The whole-RL-step oracle (docs/rl-steps.md): a GRPO trainer's step from a case's finished generations and rewards
// to the gradient at every optimizer step of one generation batch, in fp64, as TRL 1.16.0 documents and implements
// it. The stages are those of core/objectives/rl_step.h (advantages, rows, micro-steps); the log-probs are the
// policy's on each sequence unpadded (our model on right-padded rows: no pad is attended, ARCHITECTURE.md §3); the
// loss of each micro-step is the GRPO objective (core/objectives/grpo.h, checked against TRL's formulas by
// tests/oracle/objective_parity.py) with that micro-step's normaliser; old (and reference) log-probs come from the
// weights of generation time; plain SGD at the case's learning_rate moves the weights between optimizer steps.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/io/safetensors.h"
#include "core/objectives/batch.h"
#include "core/objectives/rl_step.h"

namespace sbp {

class Model;

// The stages of the oracle, each replaceable, so that tests/support/faulty_rl_step.h can plant one known bug per stage
// (the negative controls) without a fault in this code. rl_step_stages() gives the documented ones.
struct RlStepStages {
  std::function<at::Tensor(const RlStepCase&)> advantages;
  std::function<Batch(const RlStepCase&, const at::Tensor& advantages)> rows;
  std::function<std::vector<RlMicroStep>(const RlStepCase&, const Batch& rows)> micro_steps;
  // Whether a micro-step's old log-probs are the generation-time policy's (true, TRL) or the current weights' (the
  // current policy detached: right only before the first optimizer step).
  bool old_logps_from_generation = true;
};
RlStepStages rl_step_stages();

struct RlStepResult {
  at::Tensor advantages;   // [N] fp64, per completion
  at::Tensor token_logps;  // [N, max_completion_length] fp64: generation-time log-prob of each kept completion token
                           // (scored or not), 0 after
  at::Tensor completion_mask;  // [N, max_completion_length] int64: the tokens the loss scores (TRL's completion_mask)
  std::vector<double> losses;  // per optimizer step: the sum of its micro-steps' losses
  std::vector<TensorList> gradients;  // per optimizer step, HF names: what the optimizer receives
};

// Runs the case on `model` (fp64 for an oracle; its weights move by SGD when the case has several optimizer steps and
// a learning_rate, and are left moved). `method` is a BP method spec (baselines/methods.h): standard by default.
// Throws InputError naming `source` for a bad case.
RlStepResult run_rl_step(Model& model, const RlStepCase& c, const RlStepStages& stages = rl_step_stages(),
                         const std::string& method = "standard", const std::string& source = "case");

// Where `other` departs from `expected`: advantages, the token log-probs, the completion mask, each optimizer step's
// gradient by tensor (normwise relative error above rtol). Each problem names the tensor ("advantages",
// "step 2 gradient model.layers.0.mlp.up_proj.weight"); empty when they agree.
std::vector<std::string> rl_step_differences(const RlStepResult& expected, const RlStepResult& other, double rtol);

// The result as safetensors for a caller in another process (tests/oracle/rl_step_parity.py): `advantages`,
// `token_logps`, `completion_mask`, and for optimizer step k (1-based) every gradient as "step{k}/{HF name}".
TensorList rl_step_tensors(const RlStepResult& r);

}  // namespace sbp
