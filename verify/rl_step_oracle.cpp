#include "verify/rl_step_oracle.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>

#include "baselines/methods.h"
#include "core/methods/method.h"
#include "core/methods/streaming.h"
#include "core/model/model.h"
#include "core/objectives/objective.h"
#include "verify/grad_compare.h"

namespace sbp {

RlStepStages rl_step_stages() {
  RlStepStages s;
  s.advantages = [](const RlStepCase& c) {
    return rl_advantages(c.rewards, c.settings.reward_weights, c.settings.num_generations, c.settings.scale_rewards,
                         c.settings.advantage_epsilon);
  };
  s.rows = rl_rows;
  s.micro_steps = rl_micro_steps;
  return s;
}

namespace {

// [N, T] per-token tensor of the rows -> [N, C] over each row's completion (C = max_completion_length): TRL's layout,
// whatever each prompt's length. A row's completion is its last kept-completion-many attended tokens.
at::Tensor completion_part(const at::Tensor& per_token, const Batch& rows, const RlStepCase& c) {
  const auto N = per_token.size(0), C = c.settings.max_completion_length;
  auto out = at::zeros({N, C}, per_token.options());
  for (std::int64_t r = 0; r < N; ++r) {
    const auto kept = keep_completion(c.completions[r], c.settings.eos_token_id).length;
    const auto start = rows.attention_mask[r].sum().item<std::int64_t>() - kept;
    out[r].narrow(0, 0, kept).copy_(per_token[r].narrow(0, start, kept));
  }
  return out;
}

// The rows' per-token log-probs under the model as it is now (every token; the caller masks). Under LoRA the
// reference is the base (adapters off), as TRL's PEFT path.
at::Tensor scored_logps(const Model& model, const Batch& rows, double temperature, bool base) {
  std::optional<Model::AdaptersDisabled> off;
  if (base && model.lora().enabled()) off.emplace(model);
  return sequence_logps(model, rows.input_ids, temperature).to(at::kDouble);
}

}  // namespace

RlStepResult run_rl_step(Model& model, const RlStepCase& c, const RlStepStages& stages, const std::string& method_spec,
                         const std::string& source) {
  check_rl_step_case(c, model.config(), source);
  const auto& o = c.settings;
  RlStepResult out;
  out.advantages = stages.advantages(c);
  Batch rows = stages.rows(c, out.advantages);
  validate_tokens(rows, model.config(), source + ": rows");
  const auto objective = make_objective(rl_objective_spec(o));
  const auto method = make_method(method_spec);
  // Generation time: the weights the completions were sampled with give old_logps, and (first cycle) the reference.
  const auto scored = rows.field("completion_mask").to(at::kDouble);
  const auto old = scored_logps(model, rows, o.temperature, /*base=*/false);
  rows.fields["old_logps"] = old * scored;
  if (o.beta > 0) rows.fields["ref_logps"] = scored_logps(model, rows, o.temperature, /*base=*/true) * scored;
  out.token_logps = completion_part(old, rows, c);  // every kept token's, scored or not (TRL computes them all)
  out.completion_mask = completion_part(rows.field("completion_mask"), rows, c);

  const auto steps = stages.micro_steps(c, rows);
  const auto optimizer_steps = rl_optimizer_steps(c);
  out.gradients.assign(std::size_t(optimizer_steps), {});
  out.losses.assign(std::size_t(optimizer_steps), 0.0);
  for (auto& g : out.gradients)
    for (const auto& p : model.trainable()) g.push_back({p.name, at::zeros_like(p.tensor, at::kDouble)});
  for (const auto& m : steps) {
    const auto index = at::tensor(m.rows, at::kLong);
    Batch micro = rows.select_rows(index);
    if (!stages.old_logps_from_generation) micro.fields.erase("old_logps");
    if (micro.field("completion_mask").sum().item<std::int64_t>() == 0) continue;  // nothing scored: no gradient
    const auto result = method->step(model, *objective, micro, {.accumulate = false, .step_totals = m.totals});
    auto& acc = out.gradients[std::size_t(m.optimizer_step)];
    const auto grads = model.gradients();
    for (std::size_t i = 0; i < grads.size(); ++i) acc[i].tensor.add_(grads[i].tensor.to(at::kDouble), m.scale);
    out.losses[std::size_t(m.optimizer_step)] += m.scale * result.loss;
    const bool closes_step = &m == &steps.back() || (&m + 1)->optimizer_step != m.optimizer_step;
    if (closes_step && o.learning_rate != 0) {  // SGD: what the next optimizer step's micro-batches see
      at::NoGradGuard no_grad;
      for (std::size_t i = 0; i < acc.size(); ++i)
        model.trainable()[i].tensor.sub_(acc[i].tensor.to(model.trainable()[i].tensor.scalar_type()), o.learning_rate);
    }
  }
  model.zero_grad();
  return out;
}

std::vector<std::string> rl_step_differences(const RlStepResult& expected, const RlStepResult& other, double rtol) {
  std::vector<std::string> problems;
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const auto relative = [kInf](const at::Tensor& a, const at::Tensor& b) {
    if (!a.sizes().equals(b.sizes())) return kInf;
    const auto scale = std::max(a.abs().max().item<double>(), 1e-300);
    const double err = (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() / scale;
    return std::isnan(err) ? kInf : err;
  };
  for (const auto& [name, a, b] : {std::tuple{"advantages", expected.advantages, other.advantages},
                                   {"token_logps", expected.token_logps, other.token_logps}}) {
    const auto err = relative(a, b);
    if (!(err <= rtol)) problems.push_back(fmt::format("{}: relative error {:.3e} (allowed {:.0e})", name, err, rtol));
  }
  if (!expected.completion_mask.sizes().equals(other.completion_mask.sizes()) ||
      !expected.completion_mask.equal(other.completion_mask))
    problems.push_back("completion_mask: the scored tokens differ");
  if (expected.gradients.size() != other.gradients.size()) {
    problems.push_back(fmt::format("gradients: {} optimizer steps, expected {}", other.gradients.size(),
                                   expected.gradients.size()));
    return problems;
  }
  for (std::size_t k = 0; k < expected.gradients.size(); ++k) {
    const auto cmp = compare_gradients(expected.gradients[k], other.gradients[k], {"the oracle", "the other step"});
    for (const auto& p : cmp.problems) problems.push_back(fmt::format("step {} gradient: {}", k + 1, p));
    for (const auto& t : cmp.tensors)
      if (!(t.normwise_rel <= rtol))
        problems.push_back(fmt::format("step {} gradient {}: normwise relative error {:.3e} (allowed {:.0e})", k + 1,
                                       t.name, t.normwise_rel, rtol));
  }
  return problems;
}

TensorList rl_step_tensors(const RlStepResult& r) {
  TensorList out = {{"advantages", r.advantages}, {"token_logps", r.token_logps}, {"completion_mask", r.completion_mask}};
  for (std::size_t k = 0; k < r.gradients.size(); ++k)
    for (const auto& g : r.gradients[k]) out.push_back({fmt::format("step{}/{}", k + 1, g.name), g.tensor});
  return out;
}

}  // namespace sbp
