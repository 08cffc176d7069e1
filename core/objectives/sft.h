// Supervised fine-tuning with HF's convention: position t predicts labels[t + 1] (-100 = ignored); loss = sum of
// the NLL / number of valid shifted labels in the whole batch (not per chunk, not per row).
#pragma once

#include "core/objectives/objective.h"
#include "core/io/spec.h"

namespace sbp {

// Packed rows (Batch::packed) are SFT's as HF packs them: every sequence's tokens are scored as in a row of its own,
// normalised by the step's target count (not per sequence or per pack), and no target crosses a boundary.
class SftObjective : public Objective {
 public:
  explicit SftObjective(const Spec& spec = Spec{"objective", "sft", {}});
  std::string spec() const override { return "sft"; }
  Batch random_batch(const ModelConfig& config, const RandomBatchOptions& options) const override;
  double default_prompt_fraction() const override { return 0.1; }
  std::string packed_rows_refusal() const override { return ""; }

 protected:
  Fields prepare_fields(const Batch& batch, const ModelConfig& config, const std::optional<StepTotals>& step_totals,
                        const std::string& source) const override;

 private:
  struct State;
  at::Tensor token_loss(const PreparedObjective& prepared, const at::Tensor& logp, std::int64_t start) const override;
};

}  // namespace sbp
