// DPO with TRL's sigmoid loss. Rows 0..P-1 are the chosen completions, P..2P-1 the rejected ones (pair p = rows p
// and P+p). With S_r = the summed log-probs of row r's completion tokens (the first included: the last prompt
// position predicts it) and ref_r the reference's sum:
//   z_p = beta·((S_p - ref_p) - (S_{P+p} - ref_{P+p})),  L = mean_p [-(1 - ls)·log σ(z_p) - ls·log σ(-z_p)]
// (ls = label_smoothing, as TRL 0.17 had it). L couples a row's positions through S: a row term (objective.h).
#pragma once

#include "core/objectives/objective.h"
#include "core/io/spec.h"

namespace sbp {

// Not final: the negative controls' faulty subclasses (tests/support/faulty_objectives.h) override prepare_fields and
// statistics_rest.
class DpoObjective : public Objective {
 public:
  struct Options {
    double beta = 0.1, label_smoothing = 0.0;  // TRL's defaults
  };

  explicit DpoObjective(const Spec& spec);
  std::string spec() const override;

  // --batch counts rows (P chosen + P rejected, even); pair p's rows share a prompt.
  Batch random_batch(const ModelConfig& config, const RandomBatchOptions& options) const override;
  bool wants_policy_logps() const override { return true; }
  // Without a reference model: ref_logps = row sums of (policy + N(0, 0.3²)) log-probs, so that margins are not 0.
  void add_synthetic_logps(Batch& batch, const at::Tensor& token_logps, std::uint64_t seed,
                           bool reference_given) const override;
  bool needs_reference(const Batch& batch) const override { return !batch.has("ref_logps"); }
  // Pairs stay whole: micro-batch k has chosen rows [k*P/K, (k+1)*P/K) and the rejected rows P + the same.
  std::vector<Batch> split(const Batch& batch, std::int64_t parts, const std::string& source) const override;
  bool paired_rows() const override { return true; }
  Batch with_reference(const Batch& batch, const at::Tensor& token_logps) const override;
  bool has_row_term() const override { return true; }
  std::string packed_rows_refusal() const override;

 protected:
  Fields prepare_fields(const Batch& batch, const ModelConfig& config, const std::optional<StepTotals>& step_totals,
                        const std::string& source) const override;

 private:
  struct State;
  at::Tensor token_loss(const PreparedObjective& prepared, const at::Tensor& logp, std::int64_t start) const override;
  at::Tensor row_statistics(const PreparedObjective& prepared, const at::Tensor& logp, std::int64_t start) const override;
  at::Tensor row_loss(const PreparedObjective& prepared, const at::Tensor& S) const override;

  Options options_;
};

}  // namespace sbp
