#include "tests/support/faulty_rl_step.h"

#include <algorithm>

#include <ATen/ATen.h>

namespace sbp::test {

RlStepStages pads_attended_stages() {
  auto s = rl_step_stages();
  s.rows = [](const RlStepCase& c, const at::Tensor& advantages) {
    RlStepCase padded = c;
    std::size_t longest = 0;
    for (const auto& p : c.prompts) longest = std::max(longest, p.size());
    for (auto& p : padded.prompts) p.insert(p.begin(), longest - p.size(), c.settings.pad_token_id);
    return rl_rows(padded, advantages);  // the pads count as prompt tokens: attended
  };
  return s;
}

RlStepStages eos_mask_off_by_one_stages() {
  auto s = rl_step_stages();
  s.rows = [](const RlStepCase& c, const at::Tensor& advantages) {
    Batch b = rl_rows(c, advantages);
    auto mask = b.fields.at("completion_mask");
    for (std::int64_t r = 0; r < c.rows(); ++r)
      if (!keep_completion(c.completions[r], c.settings.eos_token_id).truncated)
        mask[r][b.attention_mask[r].sum().item<std::int64_t>() - 1] = 0;  // the EOS: the row's last attended token
    return b;
  };
  return s;
}

RlStepStages batch_normalised_advantages_stages() {
  auto s = rl_step_stages();
  s.advantages = [](const RlStepCase& c) {
    const auto N = c.rows();
    return rl_advantages(c.rewards, c.settings.reward_weights, /*group=*/N, c.settings.scale_rewards);
  };
  return s;
}

RlStepStages per_micro_batch_normaliser_stages() {
  auto s = rl_step_stages();
  s.micro_steps = [](const RlStepCase& c, const Batch& rows) {
    auto steps = rl_micro_steps(c, rows);
    const auto tokens_of_row = rows.field("completion_mask").sum(1);
    for (auto& m : steps) {
      std::int64_t tokens = 0;
      for (const auto r : m.rows) tokens += tokens_of_row[r].item<std::int64_t>();
      m.totals.tokens = std::max<std::int64_t>(1, tokens) * c.settings.gradient_accumulation_steps;
      m.scale = 1.0;
    }
    return steps;
  };
  return s;
}

RlStepStages old_logps_from_current_pass_stages() {
  auto s = rl_step_stages();
  s.old_logps_from_generation = false;
  return s;
}

}  // namespace sbp::test
