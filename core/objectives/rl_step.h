// A whole GRPO trainer step, from finished generations to what the optimizer receives (docs/rl-steps.md), in the
// names of TRL's GRPOConfig (1.16.0). This file holds the step's arithmetic that needs no model: the completions kept
// after the first EOS, the advantages from the rewards, the rows the policy scores (each sequence unpadded: prompt,
// kept completion, right pads that nothing attends), and the micro-steps of one generation batch with each one's
// normaliser. verify/rl_step_oracle.h runs them on a model.
//
// One generation batch (P prompts x G completions, in TRL's order: the G completions of a prompt are consecutive rows)
// is cut into steps_per_generation micro-batches of per_device_train_batch_size rows, gone through num_iterations
// times; an optimizer step closes every gradient_accumulation_steps micro-steps. The case must end at an optimizer
// step (steps_per_generation * num_iterations a multiple of gradient_accumulation_steps), so that every gradient the
// oracle reports is one the optimizer receives, with the old log-probs of this generation batch.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/model/config.h"
#include "core/objectives/batch.h"
#include "core/objectives/objective.h"

namespace sbp {

// TRL's GRPOConfig keys that shape the step (its defaults where TRL has one that matters here).
struct RlStepSettings {
  std::int64_t num_generations = 2;
  std::int64_t per_device_train_batch_size = 2;  // rows of one micro-batch
  std::int64_t gradient_accumulation_steps = 1;
  std::int64_t steps_per_generation = 0;  // 0: gradient_accumulation_steps, as TRL
  std::int64_t num_iterations = 1;
  std::int64_t max_completion_length = 8;
  std::string scale_rewards = "group";  // group | batch | none (TRL's aliases: true = group, false = none)
  std::string loss_type = "dapo";       // grpo | bnpo | dr_grpo | dapo
  std::string importance_sampling_level = "token";  // token | sequence
  double beta = 0.0, epsilon = 0.2, epsilon_high = -1.0 /* < 0: epsilon */, temperature = 1.0;
  bool mask_truncated_completions = false;
  // TRL 1.16.0's default: the KL term times the importance ratio (DeepSeek-V3.2's unbiased estimator): the GRPO
  // objective's kl=k3_ratio. Token importance only: with sequence importance and beta > 0 a case must set it false.
  bool use_bias_correction_kl = true;
  std::vector<double> reward_weights;  // one per reward function (empty: 1 each)
  std::int64_t eos_token_id = 1, pad_token_id = 0;
  double learning_rate = 0.0;  // plain SGD (no momentum, no decay) between the optimizer steps of the case
  // A library that documents another normaliser declares it (issue #60): verl's actor names its aggregation
  // loss_agg_mode (token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm), each over the
  // optimizer step's mini-batch, and then replaces loss_type's. Empty: TRL's loss_type.
  std::string loss_agg_mode;
  // The advantages' std term: (r - mean) / (std + advantage_epsilon). TRL's 1e-4; verl's GRPO estimator 1e-6.
  double advantage_epsilon = 1e-4;

  std::int64_t generation_steps() const { return steps_per_generation > 0 ? steps_per_generation : gradient_accumulation_steps; }
  double epsilon_upper() const { return epsilon_high >= 0 ? epsilon_high : epsilon; }
};

struct RlStepCase {
  std::vector<std::vector<std::int64_t>> prompts;      // P prompts, token ids, uneven lengths allowed
  std::vector<std::vector<std::int64_t>> completions;  // P * G raw generations (row r answers prompt r / G): tokens
                                                       // after the first EOS are generated but masked
  at::Tensor rewards;  // [P * G, F] fp64: completion r under reward function f
  // The rows of each of the steps_per_generation micro-batches (TRL shuffles the generation batch before cutting it:
  // a case records the order it ran). Empty: rows in order.
  MicroBatchRows micro_batches;
  RlStepSettings settings;

  std::int64_t rows() const { return std::int64_t(completions.size()); }
};

// A case from its JSON file (docs/rl-steps.md "The case file"); Throws InputError naming `file` and the key.
RlStepCase read_rl_step_case(const std::filesystem::path& file);
RlStepCase parse_rl_step_case(const std::string& json_text, const std::string& source);
// Everything a case promises, against the model's vocabulary; Throws InputError naming `source` and what is wrong.
void check_rl_step_case(const RlStepCase& c, const ModelConfig& config, const std::string& source);

// How much of a raw generation the trainer keeps: up to and including the first EOS (`length`), or all of it when it
// has none (then `truncated`: generation stopped at max_completion_length).
struct KeptCompletion {
  std::int64_t length = 0;
  bool truncated = false;
};
KeptCompletion keep_completion(const std::vector<std::int64_t>& raw, std::int64_t eos_token_id);

// Rewards [N, F] combined with the weights (sum_f w_f r_f), minus the mean of the prompt's group of G, divided by
// (std + epsilon) of the group ("group"), of the whole generation batch ("batch"), or not ("none"); std
// Bessel-corrected. TRL 1.16.0's sum_then_normalize (epsilon 1e-4; verl's GRPO estimator 1e-6). [N] fp64.
at::Tensor rl_advantages(const at::Tensor& rewards, const std::vector<double>& weights, std::int64_t group,
                         const std::string& scale_rewards, double epsilon = 1e-4);

// The rows the policy scores, one per completion: its prompt, its kept completion, right pads (pad_token_id) that
// nothing attends (ARCHITECTURE.md §3), and the GRPO objective's fields: completion_mask (0 on a truncated
// completion under mask_truncated_completions) and `advantages`.
Batch rl_rows(const RlStepCase& c, const at::Tensor& advantages);

// One micro-step: the rows it trains on, its normaliser (prepare the GRPO objective with `totals`, then scale the
// gradient by `scale`) and the optimizer step (0-based) it belongs to.
struct RlMicroStep {
  std::vector<std::int64_t> rows;
  StepTotals totals;
  double scale = 1.0;
  std::int64_t optimizer_step = 0;
  std::int64_t iteration = 0;  // 0-based pass over the generation batch
};
// Every micro-step of the case, in TRL's order, from the rows' completion_mask (rl_rows). The normalisers are
// TRL 1.16.0's _compute_loss: grpo and bnpo per micro-batch (its rows, its tokens), divided by the accumulation
// steps; dr_grpo by rows x max_completion_length, divided likewise; dapo by the generation batch's tokens
// (num_items_in_batch) x gradient_accumulation_steps / steps_per_generation. A declared loss_agg_mode (verl 0.9.1's
// agg_loss with its global batch info) normalises over the optimizer step instead: token-mean by its kept tokens,
// the seq-mean modes by its rows (ppo_mini_batch_size x n); -token-sum-norm also by max_completion_length (its
// loss_scale_factor), -token-sum not.
std::vector<RlMicroStep> rl_micro_steps(const RlStepCase& c, const Batch& rows);
std::int64_t rl_optimizer_steps(const RlStepCase& c);

// The GRPO objective (core/objectives/grpo.h) of the case's settings.
std::string rl_objective_spec(const RlStepSettings& s);

}  // namespace sbp
