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

at::Tensor PerChunkNormalisedGrpo::token_weights(const PreparedObjective&, const at::Tensor& mask, std::int64_t) const {
  const auto in_chunk = mask.sum(1, /*keepdim=*/true).clamp_min(1.0);
  return options().loss_type == "grpo" ? 1.0 / (double(mask.size(0)) * in_chunk) : 1.0 / in_chunk.sum().clamp_min(1.0);
}

namespace {

// [n] fp64: the sum over each sequence's row of `per_sequence` [n], given back per sequence.
at::Tensor row_sums(const at::Tensor& per_sequence, const at::Tensor& row_of_sequence) {
  const auto rows = row_of_sequence.max().item<std::int64_t>() + 1;
  const auto sums = at::zeros({rows}, per_sequence.options()).index_add_(0, row_of_sequence, per_sequence);
  return sums.index_select(0, row_of_sequence);
}

}  // namespace

at::Tensor PerRowAdvantageGrpo::sequence_advantages(const PreparedObjective& prepared) const {
  const auto& row = row_of_sequence(prepared);
  const auto n = row.size(0);
  // The first sequence of each row: the one whose predecessor lies in another row (or none).
  const auto first = at::cat({at::ones({1}, row.options()), (row.slice(0, 1) != row.slice(0, 0, n - 1)).to(at::kLong)});
  const auto first_index = at::arange(n, row.options()).masked_select(first == 1);  // [B]
  return GrpoObjective::sequence_advantages(prepared).index_select(0, first_index.index_select(0, row));
}

at::Tensor RowRatioGrpo::row_statistics(const PreparedObjective& prepared, const at::Tensor& logp,
                                        std::int64_t start) const {
  // S'_s / n_s = (the row's sum) / (the row's count): every sequence of the row gets the row's mean log-ratio.
  const auto S = GrpoObjective::row_statistics(prepared, logp, start);
  const auto& row = row_of_sequence(prepared);
  const auto counts = sequence_counts(prepared).to(S.scalar_type());
  return row_sums(S, row) * counts / row_sums(counts, row).clamp_min(1.0);
}

at::Tensor PerPackNormalisedGrpo::sequence_weights(const PreparedObjective& prepared) const {
  const auto& row = row_of_sequence(prepared);
  const double rows = double(row.max().item<std::int64_t>() + 1);
  if (options().loss_type == "dr_grpo")
    return at::full({row.size(0)}, 1.0 / (rows * double(options().max_completion_length)),
                    sequence_counts(prepared).options());
  return 1.0 / (rows * row_sums(sequence_counts(prepared), row).clamp_min(1.0));
}

}  // namespace sbp::test
