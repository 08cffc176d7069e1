// conform's whole-RL-step cases (issue #60, docs/rl-steps.md): the rl set, what case.json says of one, and the
// judge of what a trainer returns against the RL step oracle.
#include "verify/conform_rl.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "verify/grad_compare.h"

namespace sbp {
namespace {

// One generation batch for the whole-RL-step cases (issue #60): 3 prompts of lengths 3, 5 and 2, G = 2 completions
// each in TRL's order. Row 0 stops at an EOS and generates on (the tail must be masked), rows 1 and 5 are truncated at
// max_completion_length (no EOS), row 2 is a lone EOS, rows 3 and 4 end at theirs: kept lengths 3, 5, 1, 2, 4, 5.
// Two reward functions, every value exact in fp32 (TRL builds its reward table in torch's default dtype).
constexpr const char* kRlGenerations = R"("prompts": [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]],
  "completions": [[7, 9, 1, 4, 4], [11, 12, 13, 14, 15], [1, 30, 31], [21, 1], [40, 41, 42, 1], [50, 51, 52, 53, 54]],
  "rewards": [[1.0, 0.5], [0.0, 1.0], [0.25, 0.0], [2.0, 0.5], [0.5, 0.5], [1.5, 0.0]])";

// A whole RL step on tiny's Qwen3 shape in fp64: the generations above, `settings` (TRL's GRPOConfig names beside
// the shared ones) and a micro-batch layout. Two micro-batches of 3 rows hold 14 and 6 completion tokens and mix the
// prompts' groups, so a normaliser per micro-batch and a group taken as a micro-batch both show.
ConformCase rl_case(const ModelConfig& config, std::string name, std::string description, const std::string& settings,
                    const std::string& micro_batches, std::uint64_t seed) {
  const auto text = fmt::format(R"({{{}, "micro_batches": {},
  "settings": {{"num_generations": 2, "max_completion_length": 5, "eos_token_id": 1, "pad_token_id": 0, {}}}}})",
                                kRlGenerations, micro_batches, settings);
  ConformCase c;
  c.name = std::move(name);
  c.description = std::move(description);
  c.config = config;
  c.rl_step = parse_rl_step_case(text, "rl case " + c.name);
  c.objective = rl_objective_spec(c.rl_step->settings);
  c.batch = {c.rl_step->rows(), 0, 0, 0, seed, c.rl_step->settings.num_generations};
  check_rl_step_case(*c.rl_step, c.config, "rl case " + c.name);
  return c;
}

// An rl_step case's settings as case.json states them: every key resolved (no default left to the reader), in TRL's
// GRPOConfig names and values, beside the oracle's own (eos_token_id, pad_token_id, learning_rate: plain SGD's).
nlohmann::json rl_step_settings_json(const RlStepCase& r) {
  const auto& o = r.settings;
  auto weights = o.reward_weights;
  if (weights.empty()) weights.assign(std::size_t(r.rewards.size(1)), 1.0);
  nlohmann::json out = {
      {"num_generations", o.num_generations}, {"per_device_train_batch_size", o.per_device_train_batch_size},
          {"gradient_accumulation_steps", o.gradient_accumulation_steps},
          {"steps_per_generation", o.generation_steps()}, {"num_iterations", o.num_iterations},
          {"max_completion_length", o.max_completion_length}, {"scale_rewards", o.scale_rewards},
          {"loss_type", o.loss_type}, {"importance_sampling_level", o.importance_sampling_level}, {"beta", o.beta},
          {"epsilon", o.epsilon}, {"epsilon_high", o.epsilon_upper()}, {"temperature", o.temperature},
          {"mask_truncated_completions", o.mask_truncated_completions},
          {"use_bias_correction_kl", o.use_bias_correction_kl}, {"reward_weights", weights},
          {"eos_token_id", o.eos_token_id}, {"pad_token_id", o.pad_token_id}, {"learning_rate", o.learning_rate}};
  // A library's declaration (as_verl) only: TRL's cases keep GRPOConfig's names alone, which TRL's adapter passes on.
  if (!o.loss_agg_mode.empty()) out["loss_agg_mode"] = o.loss_agg_mode;
  if (o.advantage_epsilon != RlStepSettings{}.advantage_epsilon) out["advantage_epsilon"] = o.advantage_epsilon;
  return out;
}

// The rl set as verl 0.9.1 documents its actor update (issue #60: "where a library documents another normalisation,
// it declares it"): each case's loss_type by the loss_agg_mode that is its counterpart, normalised as verl's agg_loss
// does over the optimizer step's mini-batch (dapo -> token-mean, grpo -> seq-mean-token-mean, dr_grpo ->
// seq-mean-token-sum-norm with loss_scale_factor max_completion_length; bnpo, a per-micro-batch token count verl
// does not have, -> token-mean only where one micro-batch is the optimizer step and the two agree), and the GRPO
// estimator's std term (verl's compute_grpo_outcome_advantage adds 1e-6 where TRL adds 1e-4). Everything else is the
// case as TRL states it: what verl cannot express its adapter declines.
ConformCase as_verl(ConformCase c) {
  auto& o = c.rl_step->settings;
  if (o.loss_type == "dapo") o.loss_agg_mode = "token-mean";
  if (o.loss_type == "grpo") o.loss_agg_mode = "seq-mean-token-mean";
  if (o.loss_type == "dr_grpo") o.loss_agg_mode = "seq-mean-token-sum-norm";
  if (o.loss_type == "bnpo" && o.gradient_accumulation_steps == 1) o.loss_agg_mode = "token-mean";
  o.advantage_epsilon = 1e-6;
  c.name += "-verl";
  c.description += "; declared as verl 0.9.1 documents it (" +
                   (o.loss_agg_mode.empty() ? "no loss_agg_mode for " + o.loss_type : "loss_agg_mode " + o.loss_agg_mode) +
                   ", advantages' std + 1e-6)";
  c.objective = rl_objective_spec(o);
  return c;
}

}  // namespace

// Several loss_types and scale_rewards, an optimizer step of two micro-batches, steps_per_generation > 1 (two
// optimizer steps of one generation batch, old log-probs from generation time), num_iterations > 1, the KL term with
// and without TRL's bias correction, sequence importance, masked truncated completions (dr_grpo's and dapo's
// normalisers), one micro-batch at temperatures 0.9 and 1.
std::vector<ConformCase> rl_cases(const ModelConfig& config) {
  const std::string two = "[[4, 1, 5], [0, 2, 3]]", one = "[[0, 1, 2, 3, 4, 5]]";
  return {
      rl_case(config, "rl-dapo-group-ga2", "dapo, scale_rewards group, beta 0.04, temperature 0.9: one optimizer step of 2 "
              "micro-batches (gradient_accumulation_steps 2)", R"("loss_type": "dapo", "scale_rewards": "group",
              "beta": 0.04, "temperature": 0.9, "per_device_train_batch_size": 3, "gradient_accumulation_steps": 2,
              "reward_weights": [1.0, 0.5])", two, 41),
      rl_case(config, "rl-grpo-batch-spg2", "grpo, scale_rewards batch: steps_per_generation 2, two optimizer steps of one "
              "generation batch (SGD 0.02 between them; old_logps from generation time)", R"("loss_type": "grpo",
              "scale_rewards": "batch", "beta": 0.0, "per_device_train_batch_size": 3, "gradient_accumulation_steps": 1,
              "steps_per_generation": 2, "learning_rate": 0.02, "reward_weights": [1.0, 0.5])", two, 42),
      rl_case(config, "rl-bnpo-none-iter2-sequence", "bnpo, scale_rewards none, sequence importance, epsilon_high 0.28, beta "
              "0.04: num_iterations 2, each optimizer step 2 micro-batches (SGD 0.02)", R"("loss_type": "bnpo",
              "scale_rewards": "none", "beta": 0.04, "importance_sampling_level": "sequence", "epsilon_high": 0.28,
              "use_bias_correction_kl": false, "per_device_train_batch_size": 3, "gradient_accumulation_steps": 2,
              "num_iterations": 2, "learning_rate": 0.02, "reward_weights": [0.5, 2.0])", two, 43),
      rl_case(config, "rl-dr_grpo-masktrunc-ga2", "dr_grpo, scale_rewards true (group), mask_truncated_completions: one "
              "optimizer step of 2 micro-batches", R"("loss_type": "dr_grpo", "scale_rewards": true, "beta": 0.0,
              "mask_truncated_completions": true, "per_device_train_batch_size": 3, "gradient_accumulation_steps": 2,
              "reward_weights": [1.0, 1.0])", two, 44),
      rl_case(config, "rl-dapo-kl-spg2", "dapo, beta 0.04 with TRL's default use_bias_correction_kl: steps_per_generation 2, "
              "two optimizer steps (SGD 0.02), the KL term's gradient non-zero at the second", R"("loss_type": "dapo",
              "scale_rewards": "group", "beta": 0.04, "use_bias_correction_kl": true, "per_device_train_batch_size": 3,
              "gradient_accumulation_steps": 1, "steps_per_generation": 2, "learning_rate": 0.02,
              "reward_weights": [1.0, 0.5])", two, 45),
      rl_case(config, "rl-dapo-masktrunc-ga2", "dapo, mask_truncated_completions, beta 0: one optimizer step of 2 "
              "micro-batches, dapo's normaliser the step's kept tokens (the truncated completions' masked)",
              R"("loss_type": "dapo", "scale_rewards": "group", "beta": 0.0, "mask_truncated_completions": true,
              "per_device_train_batch_size": 3, "gradient_accumulation_steps": 2, "reward_weights": [1.0, 0.5])",
              two, 46),
      // One micro-batch of the whole generation batch, as the first GRPOTrainers (0.14-0.16) run it: they generate
      // per micro-batch and have one loss each (grpo before 0.16, bnpo in 0.16).
      rl_case(config, "rl-grpo-one-t09", "grpo, scale_rewards group, beta 0.04, temperature 0.9: one micro-batch of all 6 "
              "completions", R"("loss_type": "grpo", "scale_rewards": "group", "beta": 0.04, "temperature": 0.9,
              "per_device_train_batch_size": 6, "gradient_accumulation_steps": 1, "reward_weights": [1.0, 1.0])",
              one, 47),
      rl_case(config, "rl-bnpo-one-t09", "bnpo, scale_rewards group, beta 0.04, temperature 0.9: one micro-batch of all 6 "
              "completions", R"("loss_type": "bnpo", "scale_rewards": "group", "beta": 0.04, "temperature": 0.9,
              "per_device_train_batch_size": 6, "gradient_accumulation_steps": 1, "reward_weights": [1.0, 1.0])",
              one, 48),
      rl_case(config, "rl-grpo-one-t1", "grpo, scale_rewards group, beta 0.04, temperature 1: one micro-batch of all 6 "
              "completions", R"("loss_type": "grpo", "scale_rewards": "group", "beta": 0.04, "temperature": 1.0,
              "per_device_train_batch_size": 6, "gradient_accumulation_steps": 1, "reward_weights": [1.0, 1.0])",
              one, 49),
  };
}


std::vector<ConformCase> rl_verl_cases(const ModelConfig& config) {
  std::vector<ConformCase> out;
  for (auto& c : rl_cases(config)) out.push_back(as_verl(std::move(c)));
  return out;
}

void add_rl_step_case_json(const ConformCase& c, nlohmann::json& out) {
const auto& r = *c.rl_step;
  std::vector<std::vector<double>> rewards;
  const auto table = r.rewards.contiguous();
  for (std::int64_t i = 0; i < table.size(0); ++i) {
    const auto row = table[i];
    rewards.emplace_back(row.data_ptr<double>(), row.data_ptr<double>() + row.numel());
  }
  out["rl_step"] = {{"prompts", r.prompts}, {"completions", r.completions}, {"rewards", rewards},
                    {"micro_batches", r.micro_batches}, {"settings", rl_step_settings_json(r)}};
  out["returns"] = "grads.safetensors: for every optimizer step k (1, 2, ...) of the generation batch, the gradient "
                   "the optimizer receives (no clipping) as step{k}/<HF name>, in float64; optionally the trainer's "
                   "own advantages [N], completion_mask [N, max_completion_length] and token_logps [N, "
                   "max_completion_length] (generation time), in the case's row order, each judged when there; "
                   "result.json: {} or {\"loss\": ...} (recorded, not judged). The trainer runs the case's "
                   "micro_batches in order, its completions and rewards (streambp_conform.rl)";
}

ConformVerdict judge_rl_step(const RlStepCase& c, const RlStepResult& oracle, const TensorList& got, double rtol) {
  ConformVerdict v;
  v.rule = fmt::format("fp64 RL step: every optimizer step's gradient normwise <= {:.0e} vs the oracle; advantages and "
                       "token_logps <= {:.0e}, completion_mask exact, when returned", rtol, rtol);
  TensorList gradients;
  for (std::size_t k = 0; k < oracle.gradients.size(); ++k)
    for (const auto& g : oracle.gradients[k]) gradients.push_back({fmt::format("step{}/{}", k + 1, g.name), g.tensor});
  // The trainer's own view of the generation batch, each judged when returned, in the order the trainer makes them.
  const std::vector<std::pair<std::string, at::Tensor>> stages = {{"advantages", oracle.advantages},
                                                                  {"completion_mask", oracle.completion_mask},
                                                                  {"token_logps", oracle.token_logps}};
  auto expected = gradients;
  std::map<std::string, at::Tensor> returned;
  for (const auto& t : got) returned[t.name] = t.tensor;
  bool stages_returned = false;
  for (const auto& [name, tensor] : stages)
    if (returned.count(name)) expected.push_back({name, tensor}), stages_returned = true;
  v.problem = join_problems(protocol_problems(expected, got));
  if (!v.problem.empty()) {
    if (std::none_of(got.begin(), got.end(), [](const NamedTensor& t) { return t.name.rfind("step", 0) == 0; }))
      v.problem += fmt::format("; an rl_step case returns every optimizer step's gradient as step{{k}}/<HF name> ({} "
                               "optimizer step(s) here)", oracle.gradients.size());
    return v;
  }
  // Where the loss scores a token: where the generation-time log-probs matter (a trainer may compute the others under
  // another attention mask: TRL masks a truncated completion's attention under mask_truncated_completions).
  const auto scored = oracle.completion_mask.to(at::kBool);
  std::string first_stage, stage_words;
  double first_error = 0;
  for (const auto& [name, tensor] : stages) {
    if (!returned.count(name) || !first_stage.empty()) continue;
    const auto mine = tensor.to(at::kDouble), theirs = returned.at(name).to(at::kDouble);
    double error = 0;
    std::string words;
    if (name == "completion_mask") {
      const auto wrong = (mine != theirs).sum().item<std::int64_t>();
      error = double(wrong) / double(mine.numel());
      if (wrong > 0) {
        const auto at = (mine != theirs).nonzero()[0];
        words = fmt::format("completion_mask differs at {} of {} entries (first: row {} token {}: the oracle {}, the "
                            "trainer {}): the EOS mask (the first EOS scored, nothing after it) or truncation "
                            "(mask_truncated_completions)", wrong, mine.numel(), at[0].item<std::int64_t>(),
                            at[1].item<std::int64_t>(), mine.index({at[0], at[1]}).item<double>(),
                            theirs.index({at[0], at[1]}).item<double>());
      }
    } else {
      const auto where = name == "token_logps" ? scored : at::ones_like(mine, at::kBool);
      const auto a = mine.masked_select(where), b = theirs.masked_select(where);
      error = ((a - b).abs().max() / at::clamp_min(a.abs().max(), 1e-300)).item<double>();
      if (std::isnan(error)) error = std::numeric_limits<double>::infinity();
      if (!(error <= rtol))
        words = name == "advantages"
                    ? fmt::format("advantages {:.1e} off (normwise): the rewards' weights, or scale_rewards' "
                                  "normalisation ({}: over the {}; std Bessel-corrected, + {:g})", error,
                                  c.settings.scale_rewards, c.settings.scale_rewards == "batch" ? "whole generation "
                                  "batch's std, each group's mean" : c.settings.scale_rewards == "none" ? "group's "
                                  "mean only" : "prompt's group of num_generations", c.settings.advantage_epsilon)
                    : fmt::format("token_logps {:.1e} off (normwise, on the scored tokens): the log-probs at "
                                  "generation time: pads attended (the attention mask of left-padded prompts), "
                                  "positions shifted by the padding, or the temperature", error);
    }
    if (!words.empty()) first_stage = name, first_error = error, stage_words = words;
  }
  TensorList got_gradients;
  for (const auto& t : got)
    if (t.name.rfind("step", 0) == 0) got_gradients.push_back(t);
  const auto cmp = compare_gradients(gradients, got_gradients, {kConformOracle, kConformCandidate});
  v.problem = join_problems(cmp.problems);
  if (!v.problem.empty()) return v;
  const auto* w = cmp.worst();
  const bool gradients_pass = cmp.passed(rtol);
  if (!first_stage.empty()) {
    v.worst_tensor = first_stage, v.worst = first_error;
    v.hint = fmt::format("the trainer departs first at {}; ", stage_words) +
             (w ? fmt::format("its gradients then at {} ({:.1e} normwise)", w->name, w->normwise_rel) : "");
    return v;
  }
  if (w) v.worst_tensor = w->name, v.worst = w->normwise_rel;
  v.passed = gradients_pass;
  if (!gradients_pass && w) {
    // The first optimizer step whose gradient is off: a later one alone is what happens between optimizer steps.
    std::size_t first_step = 0;
    for (const auto& t : cmp.tensors)
      if (!(t.normwise_rel <= rtol)) {
        first_step = std::size_t(std::stoul(t.name.substr(4, t.name.find('/') - 4)));
        break;
      }
    v.hint = first_step > 1
                 ? fmt::format("step 1 agrees, step {} departs: what the trainer carries between optimizer steps "
                               "(old_logps from the wrong pass: the current weights' instead of generation time's; "
                               "the update itself, e.g. clipping or the learning rate)", first_step)
                 : fmt::format("the first optimizer step departs with the stages{} agreeing: the loss's aggregation "
                               "(loss_type {}'s normaliser: per micro-batch or over the generation batch; "
                               "gradient_accumulation_steps), the micro-batch layout (the case's micro_batches, in "
                               "order), the clipped objective or the KL term", stages_returned ? "" : " not returned, or",
                               c.settings.loss_type);
  }
  return v;
}

}  // namespace sbp
