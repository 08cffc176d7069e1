#include "tests/support/faulty_objectives.h"

#include <ATen/ATen.h>

namespace sbp::test {

Objective::Fields FirstTokenSkippingDpo::prepare_fields(const Batch& batch, const ModelConfig& config,
                                                        const std::optional<StepTotals>& step_totals,
                                                        const std::string& source) const {
  auto fields = DpoObjective::prepare_fields(batch, config, step_totals, source);
  const auto completion = checked_completion_mask(batch, source);  // [B, T]
  const auto first = completion * (completion.cumsum(1) == 1);     // each row's first completion token
  fields.targets = fields.targets.masked_fill(shift_left(first, 0) == 1, -1);  // read at the position that predicts it
  return fields;
}

at::Tensor PartialStatisticsDpo::statistics_rest(const at::Tensor& total, const at::Tensor&) const {
  return at::zeros_like(total);
}

at::Tensor PerChunkNormalisedGrpo::token_weights(const PreparedObjective&, const at::Tensor& mask) const {
  const auto in_chunk = mask.sum(1, /*keepdim=*/true).clamp_min(1.0);
  return options().loss_type == "grpo" ? 1.0 / (double(mask.size(0)) * in_chunk) : 1.0 / in_chunk.sum().clamp_min(1.0);
}

}  // namespace sbp::test
