// Faulty objectives for the negative controls of the objectives' gates (ARCHITECTURE.md §8): each subclass overrides one
// protected step of DPO or GRPO with a known way of getting it wrong — the public StreamBP code's bugs among them
//. The production classes carry no switch for any of them: fault injection lives in tests.
#pragma once

#include <string>

#include <ATen/core/Tensor.h>

#include "core/objectives/dpo.h"
#include "core/objectives/grpo.h"

namespace sbp::test {

// The public StreamBP code's bug: the first completion token of every row goes unscored (the last prompt position,
// which predicts it, is left out of S).
class FirstTokenSkippingDpo : public DpoObjective {
 public:
  using DpoObjective::DpoObjective;

 protected:
  Fields prepare_fields(const Batch& batch, const ModelConfig& config, const std::optional<StepTotals>& step_totals,
                        const std::string& source) const override;
};

// Each head chunk takes its coefficient dR/dS from its own partial sums, as if S_rest were 0.
class PartialStatisticsDpo : public DpoObjective {
 public:
  using DpoObjective::DpoObjective;

 protected:
  at::Tensor statistics_rest(const at::Tensor& total, const at::Tensor& s_chunk) const override;
};

// Normalised per head chunk: completion tokens counted per chunk instead of over the batch.
class PerChunkNormalisedGrpo : public GrpoObjective {
 public:
  using GrpoObjective::GrpoObjective;

 protected:
  at::Tensor token_weights(const PreparedObjective& prepared, const at::Tensor& mask, std::int64_t start) const override;
};

// Packed rows (docs/packing.md "GRPO on packed rows"): the three ways of keeping a per-row term per row when a row holds
// several completions. Each gives the padded layout's gradients on unpacked rows, and wrong ones on packed rows.

// Every sequence of a packed row takes the advantage of the row's first sequence (an advantage indexed by row).
class PerRowAdvantageGrpo : public GrpoObjective {
 public:
  using GrpoObjective::GrpoObjective;

 protected:
  at::Tensor sequence_advantages(const PreparedObjective& prepared) const override;
};

// The sequence-level importance ratio over the whole row: each sequence's ratio is exp of its row's mean log-ratio.
class RowRatioGrpo : public GrpoObjective {
 public:
  using GrpoObjective::GrpoObjective;

 protected:
  at::Tensor row_statistics(const PreparedObjective& prepared, const at::Tensor& logp, std::int64_t start) const override;
};

// A normaliser per pack: the mean over rows of each row's token mean (grpo, bnpo, dapo) or B rows of
// max_completion_length (dr_grpo), instead of per sequence or per token of the batch.
class PerPackNormalisedGrpo : public GrpoObjective {
 public:
  using GrpoObjective::GrpoObjective;

 protected:
  at::Tensor sequence_weights(const PreparedObjective& prepared) const override;
};

}  // namespace sbp::test
