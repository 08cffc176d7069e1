// `streambp rl-step`: the whole-RL-step oracle (verify/rl_step_oracle.h, docs/rl-steps.md) on a case file and an HF
// checkpoint folder, in fp64: the advantages, the generation-time token log-probs, the completion mask and the
// gradient at every optimizer step, written to one safetensors file for a caller that judges a trainer with them
// (tests/oracle/rl_step_parity.py judges TRL's GRPOTrainer).
#include <filesystem>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "core/io/input_error.h"
#include "core/io/safetensors.h"
#include "core/model/checkpoint_io.h"
#include "core/model/model.h"
#include "experiments/commands.h"
#include "verify/rl_step_oracle.h"

namespace sbp {

void add_rl_step_options(CLI::App& app, RlStepArgs& a) {
  app.add_option("--load", a.load, "HF checkpoint folder of the policy at generation time (config.json, "
                 "model.safetensors); run in fp64")->required();
  app.add_option("--case", a.case_file, "the RL step case (JSON: prompts, completions, rewards, micro_batches, "
                 "settings in TRL's GRPOConfig names; docs/rl-steps.md)")->required();
  app.add_option("--out", a.out, "write advantages, token_logps, completion_mask and step{k}/<HF name> gradients "
                 "(safetensors)")->required();
  app.add_option("--method", a.method, "the BP method that computes each micro-step's gradient (baselines/methods.h)");
  app.add_flag("--force", a.force, "overwrite an existing --out file");
  app.footer("Plain SGD at settings.learning_rate moves the weights between the optimizer steps of the case; the "
             "gradients are those the optimizer receives, without clipping.");
}

int rl_step_command(const RlStepArgs& a, const std::string&) {
  if (!a.force && std::filesystem::exists(a.out))
    throw InputError(fmt::format("--out {} exists (give --force to overwrite it)", a.out));
  const auto c = read_rl_step_case(a.case_file);  // before the model: a bad case is refused at once
  auto model = load_model_dir(a.load, at::kDouble);
  const auto result = run_rl_step(*model, c, rl_step_stages(), a.method, a.case_file);
  write_safetensors(a.out, rl_step_tensors(result));
  for (std::size_t k = 0; k < result.losses.size(); ++k)
    fmt::print("optimizer step {}: loss {:.17g}\n", k + 1, result.losses[k]);
  fmt::print("written to {}\n", a.out);
  return 0;
}

}  // namespace sbp
