#include "core/objectives/rl_step.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/io/input_error.h"

namespace sbp {

namespace {

using Json = nlohmann::json;

// A key of `j` as T, or `fallback` when absent; a value of the wrong type is refused naming the key.
template <class T>
T get_or(const Json& j, const std::string& key, T fallback, const std::string& source) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  try {
    return j.at(key).get<T>();
  } catch (const Json::exception& e) {
    throw InputError(fmt::format("{}: '{}' has the wrong type ({})", source, key, e.what()));
  }
}

std::vector<std::vector<std::int64_t>> id_lists(const Json& j, const std::string& key, const std::string& source) {
  if (!j.contains(key) || !j.at(key).is_array())
    throw InputError(fmt::format("{}: '{}' must be a list of lists of token ids", source, key));
  return get_or<std::vector<std::vector<std::int64_t>>>(j, key, {}, source);
}

}  // namespace

RlStepCase parse_rl_step_case(const std::string& text, const std::string& source) {
  const auto j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) throw InputError(source + ": not a JSON object");
  static const std::set<std::string> keys = {"prompts", "completions", "rewards", "micro_batches", "settings"};
  for (const auto& [k, v] : j.items())
    if (!keys.count(k)) throw InputError(fmt::format("{}: unknown key '{}'", source, k));
  RlStepCase c;
  c.prompts = id_lists(j, "prompts", source);
  c.completions = id_lists(j, "completions", source);
  const auto rewards = get_or<std::vector<std::vector<double>>>(j, "rewards", {}, source);
  const auto F = rewards.empty() ? 0 : std::int64_t(rewards.front().size());
  if (rewards.size() != c.completions.size() || F == 0)
    throw InputError(fmt::format("{}: 'rewards' must hold one list per completion ({}), each one reward per reward "
                                 "function, got {} lists", source, c.completions.size(), rewards.size()));
  c.rewards = at::empty({std::int64_t(rewards.size()), F}, at::kDouble);
  for (std::size_t r = 0; r < rewards.size(); ++r) {
    if (std::int64_t(rewards[r].size()) != F)
      throw InputError(fmt::format("{}: rewards[{}] has {} values, rewards[0] has {}", source, r, rewards[r].size(), F));
    for (std::int64_t f = 0; f < F; ++f) c.rewards[std::int64_t(r)][f] = rewards[r][std::size_t(f)];
  }
  c.micro_batches = get_or<MicroBatchRows>(j, "micro_batches", {}, source);
  const Json s = j.contains("settings") ? j.at("settings") : Json::object();
  static const std::set<std::string> setting_keys = {
      "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
      "num_iterations", "max_completion_length", "scale_rewards", "loss_type", "importance_sampling_level", "beta",
      "epsilon", "epsilon_high", "temperature", "mask_truncated_completions", "reward_weights", "eos_token_id",
      "pad_token_id", "learning_rate", "use_bias_correction_kl", "loss_agg_mode", "advantage_epsilon"};
  for (const auto& [k, v] : s.items())
    if (!setting_keys.count(k)) throw InputError(fmt::format("{}: unknown setting '{}'", source, k));
  auto& o = c.settings;
  const std::string where = source + ": settings";
  o.num_generations = get_or(s, "num_generations", o.num_generations, where);
  o.per_device_train_batch_size = get_or(s, "per_device_train_batch_size", o.per_device_train_batch_size, where);
  o.gradient_accumulation_steps = get_or(s, "gradient_accumulation_steps", o.gradient_accumulation_steps, where);
  o.steps_per_generation = get_or(s, "steps_per_generation", o.steps_per_generation, where);
  o.num_iterations = get_or(s, "num_iterations", o.num_iterations, where);
  o.max_completion_length = get_or(s, "max_completion_length", o.max_completion_length, where);
  if (s.contains("scale_rewards") && s.at("scale_rewards").is_boolean())  // TRL's aliases (GRPOConfig.__post_init__)
    o.scale_rewards = s.at("scale_rewards").get<bool>() ? "group" : "none";
  else
    o.scale_rewards = get_or(s, "scale_rewards", o.scale_rewards, where);
  o.loss_type = get_or(s, "loss_type", o.loss_type, where);
  o.importance_sampling_level = get_or(s, "importance_sampling_level", o.importance_sampling_level, where);
  o.beta = get_or(s, "beta", o.beta, where);
  o.epsilon = get_or(s, "epsilon", o.epsilon, where);
  o.epsilon_high = get_or(s, "epsilon_high", o.epsilon_high, where);
  o.temperature = get_or(s, "temperature", o.temperature, where);
  o.mask_truncated_completions = get_or(s, "mask_truncated_completions", o.mask_truncated_completions, where);
  o.use_bias_correction_kl = get_or(s, "use_bias_correction_kl", o.use_bias_correction_kl, where);
  o.reward_weights = get_or(s, "reward_weights", o.reward_weights, where);
  o.eos_token_id = get_or(s, "eos_token_id", o.eos_token_id, where);
  o.pad_token_id = get_or(s, "pad_token_id", o.pad_token_id, where);
  o.learning_rate = get_or(s, "learning_rate", o.learning_rate, where);
  o.loss_agg_mode = get_or(s, "loss_agg_mode", o.loss_agg_mode, where);
  o.advantage_epsilon = get_or(s, "advantage_epsilon", o.advantage_epsilon, where);
  return c;
}

RlStepCase read_rl_step_case(const std::filesystem::path& file) {
  std::ifstream in(file);
  if (!in) throw InputError(file.string() + ": cannot read the RL step case");
  std::stringstream text;
  text << in.rdbuf();
  return parse_rl_step_case(text.str(), file.string());
}

void check_rl_step_case(const RlStepCase& c, const ModelConfig& config, const std::string& source) {
  const auto& o = c.settings;
  const auto bad = [&](const std::string& what) { throw InputError(source + ": " + what); };
  for (const auto& [name, v] : {std::pair{"num_generations", o.num_generations},
                                {"per_device_train_batch_size", o.per_device_train_batch_size},
                                {"gradient_accumulation_steps", o.gradient_accumulation_steps},
                                {"num_iterations", o.num_iterations}, {"max_completion_length", o.max_completion_length}})
    if (v < 1) bad(fmt::format("settings.{} must be >= 1, got {}", name, v));
  if (o.steps_per_generation < 0) bad("settings.steps_per_generation must be >= 1 (or 0: gradient_accumulation_steps)");
  static const std::vector<std::string> scales = {"group", "batch", "none"}, losses = {"grpo", "bnpo", "dr_grpo", "dapo"},
                                        levels = {"token", "sequence"};
  const auto member = [](const std::vector<std::string>& v, const std::string& x) {
    return std::find(v.begin(), v.end(), x) != v.end();
  };
  if (!member(scales, o.scale_rewards)) bad("settings.scale_rewards must be group, batch, none, true or false, got " + o.scale_rewards);
  if (!member(losses, o.loss_type))
    bad("settings.loss_type must be grpo, bnpo, dr_grpo or dapo (the losses this oracle documents), got " + o.loss_type);
  if (!member(levels, o.importance_sampling_level)) bad("settings.importance_sampling_level must be token or sequence");
  static const std::vector<std::string> aggregations = {"", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                                        "seq-mean-token-sum-norm"};
  if (!member(aggregations, o.loss_agg_mode))
    bad("settings.loss_agg_mode must be token-mean, seq-mean-token-mean, seq-mean-token-sum or "
        "seq-mean-token-sum-norm (verl's), got " + o.loss_agg_mode);
  if (!(o.advantage_epsilon > 0 && o.advantage_epsilon < 1))
    bad(fmt::format("settings.advantage_epsilon must be in (0, 1), got {}", o.advantage_epsilon));
  if (!(o.beta >= 0) || !(o.epsilon >= 0 && o.epsilon <= 1) || !(o.temperature > 0) || !std::isfinite(o.learning_rate))
    bad("settings: beta >= 0, 0 <= epsilon <= 1, temperature > 0 and a finite learning_rate are required");
  if (o.beta > 0 && o.use_bias_correction_kl && o.importance_sampling_level == "sequence")
    bad("settings.use_bias_correction_kl is true (TRL 1.16.0's default) with beta > 0 and sequence importance: the "
        "KL term times the row's ratio is not modelled by this oracle yet; set it false (docs/rl-steps.md)");
  const auto G = o.num_generations, P = std::int64_t(c.prompts.size()), N = c.rows();
  if (P == 0) bad("'prompts' is empty");
  if (N != P * G) bad(fmt::format("{} completions for {} prompts x num_generations {}", N, P, G));
  if (G < 2) bad("settings.num_generations must be >= 2 (a group of one has advantage 0)");
  const auto spg = o.generation_steps();
  if (N != o.per_device_train_batch_size * spg)
    bad(fmt::format("the generation batch has {} completions; TRL's is per_device_train_batch_size ({}) x "
                    "steps_per_generation ({})", N, o.per_device_train_batch_size, spg));
  if ((spg * o.num_iterations) % o.gradient_accumulation_steps != 0)
    bad(fmt::format("steps_per_generation x num_iterations ({}) is not a multiple of gradient_accumulation_steps ({}): "
                    "an optimizer step would span two generation batches, which one case does not hold",
                    spg * o.num_iterations, o.gradient_accumulation_steps));
  const auto F = c.rewards.size(1);
  if (!o.reward_weights.empty() && std::int64_t(o.reward_weights.size()) != F)
    bad(fmt::format("settings.reward_weights has {} weights for {} reward functions", o.reward_weights.size(), F));
  if (!at::isfinite(c.rewards).all().item<bool>()) bad("'rewards' holds a NaN or Inf");
  const auto in_vocab = [&](std::int64_t t) { return t >= 0 && t < config.vocab_size; };
  if (!in_vocab(o.eos_token_id) || !in_vocab(o.pad_token_id)) bad("settings.eos_token_id / pad_token_id outside the vocabulary");
  for (std::int64_t p = 0; p < P; ++p) {
    if (c.prompts[p].empty()) bad(fmt::format("prompts[{}] is empty", p));
    for (const auto t : c.prompts[p])
      if (!in_vocab(t)) bad(fmt::format("prompts[{}] holds token {}, outside the vocabulary of {}", p, t, config.vocab_size));
  }
  for (std::int64_t r = 0; r < N; ++r) {
    const auto& raw = c.completions[r];
    if (raw.empty() || std::int64_t(raw.size()) > o.max_completion_length)
      bad(fmt::format("completions[{}] has {} tokens; a generation has 1 to max_completion_length ({})", r, raw.size(),
                      o.max_completion_length));
    for (const auto t : raw)
      if (!in_vocab(t)) bad(fmt::format("completions[{}] holds token {}, outside the vocabulary", r, t));
    const auto kept = keep_completion(raw, o.eos_token_id);
    if (kept.truncated && std::int64_t(raw.size()) != o.max_completion_length)
      bad(fmt::format("completions[{}] has no EOS ({}) and {} tokens: generation stops at an EOS or at "
                      "max_completion_length ({})", r, o.eos_token_id, raw.size(), o.max_completion_length));
  }
  if (!c.micro_batches.empty()) {
    if (std::int64_t(c.micro_batches.size()) != spg) bad(fmt::format("micro_batches has {} micro-batches, "
                                                                     "steps_per_generation is {}", c.micro_batches.size(), spg));
    for (std::size_t k = 0; k < c.micro_batches.size(); ++k)
      if (std::int64_t(c.micro_batches[k].size()) != o.per_device_train_batch_size)
        bad(fmt::format("micro_batches[{}] has {} rows, per_device_train_batch_size is {}", k, c.micro_batches[k].size(),
                        o.per_device_train_batch_size));
    const auto problem = micro_batch_rows_problem(c.micro_batches, N, false);
    if (!problem.empty()) bad(problem);
  }
}

KeptCompletion keep_completion(const std::vector<std::int64_t>& raw, std::int64_t eos_token_id) {
  const auto eos = std::find(raw.begin(), raw.end(), eos_token_id);
  if (eos == raw.end()) return {std::int64_t(raw.size()), true};
  return {std::int64_t(eos - raw.begin()) + 1, false};  // the EOS itself is scored: the policy chose to stop
}

at::Tensor rl_advantages(const at::Tensor& rewards, const std::vector<double>& weights, std::int64_t group,
                         const std::string& scale_rewards, double epsilon) {
  const auto N = rewards.size(0), F = rewards.size(1);
  auto w = at::ones({F}, at::kDouble);
  for (std::size_t f = 0; f < weights.size(); ++f) w[std::int64_t(f)] = weights[f];
  const auto combined = (rewards.to(at::kDouble) * w.unsqueeze(0)).sum(1);  // [N]
  const auto grouped = combined.view({N / group, group});
  const auto mean = grouped.mean(1, /*keepdim=*/true).expand({N / group, group}).reshape({N});
  auto advantages = combined - mean;
  if (scale_rewards == "group")
    advantages = advantages / (grouped.std(1, /*unbiased=*/true, true).expand({N / group, group}).reshape({N}) + epsilon);
  else if (scale_rewards == "batch")  // the batch's std, but still each group's mean (TRL 1.16.0)
    advantages = advantages / (combined.std(/*unbiased=*/true) + epsilon);
  return advantages;
}

Batch rl_rows(const RlStepCase& c, const at::Tensor& advantages) {
  const auto& o = c.settings;
  const auto N = c.rows(), G = o.num_generations;
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(N));
  std::int64_t T = 0;
  for (std::int64_t r = 0; r < N; ++r) {
    lengths[r] = std::int64_t(c.prompts[r / G].size()) + keep_completion(c.completions[r], o.eos_token_id).length;
    T = std::max(T, lengths[r]);
  }
  Batch b;
  b.input_ids = at::full({N, T}, o.pad_token_id, at::kLong);
  b.attention_mask = at::zeros({N, T}, at::kLong);
  auto completion = at::zeros({N, T}, at::kLong);
  auto ids = b.input_ids.accessor<std::int64_t, 2>();
  auto attend = b.attention_mask.accessor<std::int64_t, 2>();
  auto scored = completion.accessor<std::int64_t, 2>();
  for (std::int64_t r = 0; r < N; ++r) {
    const auto& prompt = c.prompts[r / G];
    const auto kept = keep_completion(c.completions[r], o.eos_token_id);
    const auto P = std::int64_t(prompt.size());
    const bool masked = kept.truncated && o.mask_truncated_completions;
    for (std::int64_t t = 0; t < P; ++t) ids[r][t] = prompt[t];
    for (std::int64_t t = 0; t < kept.length; ++t) {
      ids[r][P + t] = c.completions[r][t];
      scored[r][P + t] = masked ? 0 : 1;
    }
    for (std::int64_t t = 0; t < lengths[r]; ++t) attend[r][t] = 1;
  }
  b.fields["completion_mask"] = completion;
  b.fields["advantages"] = advantages.to(at::kDouble).clone();
  return b;
}

std::int64_t rl_optimizer_steps(const RlStepCase& c) {
  const auto& o = c.settings;
  return o.generation_steps() * o.num_iterations / o.gradient_accumulation_steps;
}

std::vector<RlMicroStep> rl_micro_steps(const RlStepCase& c, const Batch& rows) {
  const auto& o = c.settings;
  const auto spg = o.generation_steps(), GA = o.gradient_accumulation_steps, B = o.per_device_train_batch_size;
  MicroBatchRows micro = c.micro_batches;
  if (micro.empty())
    for (std::int64_t k = 0; k < spg; ++k) {
      micro.emplace_back();
      for (std::int64_t i = 0; i < B; ++i) micro.back().push_back(k * B + i);
    }
  const auto tokens_of_row = rows.field("completion_mask").sum(1);
  const auto generation_tokens = std::max<std::int64_t>(1, tokens_of_row.sum().item<std::int64_t>());
  std::vector<RlMicroStep> out;
  for (std::int64_t step = 0; step < spg * o.num_iterations; ++step) {
    RlMicroStep m;
    m.rows = micro[std::size_t(step % spg)];
    m.optimizer_step = step / GA;
    m.iteration = step / spg;
    std::int64_t tokens = 0;
    for (const auto r : m.rows) tokens += tokens_of_row[r].item<std::int64_t>();
    m.totals.rows = B * GA;  // grpo, dr_grpo: the micro-batch's mean over rows, / GA
    if (o.loss_agg_mode == "token-mean") {  // verl: the optimizer step's (mini-batch's) kept tokens
      std::int64_t step_tokens = 0;
      for (std::int64_t k = step - step % GA; k < step - step % GA + GA; ++k)
        for (const auto r : micro[std::size_t(k % spg)]) step_tokens += tokens_of_row[r].item<std::int64_t>();
      m.totals.tokens = std::max<std::int64_t>(1, step_tokens);
    } else if (o.loss_agg_mode == "seq-mean-token-sum") {  // dr_grpo's form without its / max_completion_length
      m.scale = double(o.max_completion_length);
    } else if (!o.loss_agg_mode.empty()) {  // seq-mean-token-mean, -token-sum-norm: the step's rows, as grpo, dr_grpo
    } else if (o.loss_type == "bnpo") {
      m.totals.tokens = std::max<std::int64_t>(1, tokens) * GA;
    } else if (o.loss_type == "dapo") {  // num_items_in_batch * GA / spg: the generation batch's tokens, and a scale
      m.totals.tokens = generation_tokens;
      m.scale = double(spg) / double(GA);
    }
    out.push_back(std::move(m));
  }
  return out;
}

std::string rl_objective_spec(const RlStepSettings& s) {
  const bool ratio_kl = s.beta > 0 && s.use_bias_correction_kl;
  // A declared loss_agg_mode (verl's) in the GRPO objective's terms; its totals come from rl_micro_steps. verl's
  // seq-mean-token-mean divides each row's token sum by (its token count + 1e-8), the count an integer tensor:
  // count + 1e-8 is then an fp32 tensor, where 1e-8 is below half an ulp of any count >= 1: the divisor is the count
  // (measured: verl's gradient is this one's to 2e-15, one with + 1e-8 in fp64 is 8e-9 off): grpo's form.
  const std::string form = s.loss_agg_mode.empty()                      ? s.loss_type
                           : s.loss_agg_mode == "token-mean"            ? "dapo"
                           : s.loss_agg_mode == "seq-mean-token-mean"   ? "grpo"
                                                                        : "dr_grpo";
  return fmt::format("grpo:beta={},epsilon_low={},epsilon_high={},loss_type={},temperature={},importance={},"
                     "max_completion_length={}",
                     s.beta, s.epsilon, s.epsilon_upper(), form, s.temperature, s.importance_sampling_level,
                     s.max_completion_length) +
         (ratio_kl ? ",kl=k3_ratio" : "");
}

}  // namespace sbp
