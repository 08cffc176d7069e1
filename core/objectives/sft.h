// Supervised fine-tuning with HF's convention: position t predicts labels[t + 1] (-100 = ignored); loss = sum of
// the NLL / number of valid shifted labels in the whole batch (not per chunk, not per row).
#pragma once

#include "core/objectives/objective.h"
#include "core/io/spec.h"

namespace sbp {

class SftObjective final : public Objective {
 public:
  explicit SftObjective(const Spec& spec = Spec{"objective", "sft", {}});
  std::string spec() const override { return "sft"; }
  Batch random_batch(const ModelConfig& config, const RandomBatchOptions& options) const override;
  double default_prompt_fraction() const override { return 0.1; }

 private:
  struct State;
  Fields prepare_fields(const Batch& batch, const ModelConfig& config, const std::optional<StepTotals>& step_totals,
                        const std::string& source) const override;
  at::Tensor token_loss(const PreparedObjective& prepared, const at::Tensor& logp, std::int64_t start) const override;
};

}  // namespace sbp
