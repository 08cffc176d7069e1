// GRPO (TRL's formulas). Per completion token t of row b:
//   w = exp(logp - old_logp)                 (token importance; sequence: exp of the row's mean log-ratio)
//   l = -min(w·A_b, clamp(w, 1 - epsilon_low, 1 + epsilon_high)·A_b) + beta·(exp(ref - logp) - (ref - logp) - 1)
// (with kl=k3_ratio the KL term is times w, with its gradient: TRL 1.16.0's use_bias_correction_kl, token importance)
// normalised by loss_type: grpo = mean over rows of (sum_t l / n_b); bnpo and dapo = sum l / all completion tokens
// (dapo's normaliser is the whole generation batch's token count: on one process that is this batch);
// dr_grpo = sum l / (B · max_completion_length). Without old_logps the old policy is the current one, detached
// (w = 1 in value, not in gradient); beta = 0 reads no reference at all.
#pragma once

#include "core/objectives/objective.h"
#include "core/io/spec.h"

namespace sbp {

// Not final: the negative control's faulty subclass (tests/support/faulty_objectives.h) overrides token_weights.
class GrpoObjective : public Objective {
 public:
  // Defaults are TRL's current GRPOConfig (beta 0, epsilon 0.2 both sides, loss_type dapo, temperature 1, token
  // importance, max_completion_length 256). The paper's code pinned TRL 0.17: beta=0.04,loss_type=bnpo,temperature=0.9.
  struct Options {
    double beta = 0.0, epsilon_low = 0.2, epsilon_high = 0.2, temperature = 1.0;
    std::string loss_type = "dapo", importance = "token";
    std::string kl = "k3";  // or k3_ratio: the k3 KL times the token's importance ratio (TRL's use_bias_correction_kl)
    std::int64_t max_completion_length = 256;
  };

  explicit GrpoObjective(const Spec& spec);
  std::string spec() const override;
  const Options& options() const { return options_; }

  // --batch B rows in groups of --group G completions per prompt; advantages = group-normalised N(0, 1) rewards
  // ((r - mean) / (std + 1e-4), TRL's scale_rewards=group); no old_logps/ref_logps yet (add_synthetic_logps).
  Batch random_batch(const ModelConfig& config, const RandomBatchOptions& options) const override;
  bool wants_policy_logps() const override { return true; }
  // old_logps = policy + N(0, 0.3²) on completion tokens (ratios both sides of the clip range), each log-ratio (or,
  // under sequence importance, each row's mean) kept 0.1 away from the clip edges; with beta > 0 and no reference
  // model, ref_logps = policy + other N(0, 0.3²) noise.
  void add_synthetic_logps(Batch& batch, const at::Tensor& token_logps, std::uint64_t seed,
                           bool reference_given) const override;
  bool needs_reference(const Batch& batch) const override { return options_.beta > 0 && !batch.has("ref_logps"); }
  Batch with_reference(const Batch& batch, const at::Tensor& token_logps) const override;
  double temperature() const override { return options_.temperature; }
  bool has_row_term() const override { return options_.importance == "sequence"; }
  std::string packed_rows_refusal() const override;

 protected:
  // The loss_type's normaliser of each scored token of a head chunk whose scored mask is `mask` ([B, c], in the
  // log-probs' dtype): the state's weights per row, [B, 1], fixed over the batch (or the step) by prepare_fields.
  virtual at::Tensor token_weights(const PreparedObjective& prepared, const at::Tensor& mask) const;

 private:
  struct State;
  Fields prepare_fields(const Batch& batch, const ModelConfig& config, const std::optional<StepTotals>& step_totals,
                        const std::string& source) const override;
  at::Tensor token_loss(const PreparedObjective& prepared, const at::Tensor& logp, std::int64_t start) const override;
  at::Tensor row_statistics(const PreparedObjective& prepared, const at::Tensor& logp, std::int64_t start) const override;
  at::Tensor row_loss(const PreparedObjective& prepared, const at::Tensor& S) const override;
  at::Tensor clipped_surrogate(const at::Tensor& w, const at::Tensor& advantages) const;  // -min(w·A, clip(w)·A)

  Options options_;
};

}  // namespace sbp
