// GRPO (TRL's formulas). Per completion token t of row b:
//   w = exp(logp - old_logp)                 (token importance; sequence: exp of the row's mean log-ratio)
//   l = -min(w·A_b, clamp(w, 1 - epsilon_low, 1 + epsilon_high)·A_b) + beta·(exp(ref - logp) - (ref - logp) - 1)
// (with kl=k3_ratio the KL term is times w, with its gradient: TRL 1.16.0's use_bias_correction_kl, token importance)
// normalised by loss_type: grpo = mean over rows of (sum_t l / n_b); bnpo and dapo = sum l / all completion tokens
// (dapo's normaliser is the whole generation batch's token count: on one process that is this batch);
// dr_grpo = sum l / (B · max_completion_length). Without old_logps the old policy is the current one, detached
// (w = 1 in value, not in gradient); beta = 0 reads no reference at all.
// Packed rows (docs/packing.md "GRPO on packed rows") are verl's remove-padding layout: each packed sequence is one
// completion (prompt + completion), and every per-row term above becomes per sequence: A_b, n_b and the sequence-level
// ratio are the sequence's, grpo's mean and dr_grpo's B count sequences; bnpo/dapo's token count is unchanged.
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
  // With --pack: packed_grpo_batch of the drawn lengths, --group counting sequences.
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
  std::string packed_rows_refusal() const override { return ""; }

 protected:
  // The terms per sequence ("sequence" = a row, or a packed row's sequence in cu_seqlens order; n of them), [n] fp64,
  // as prepare_fields fixed them: each sequence's advantage, and the loss_type's normaliser of each of its tokens.
  // Virtual for the negative controls (tests/support/faulty_objectives.h).
  virtual at::Tensor sequence_advantages(const PreparedObjective& prepared) const;
  virtual at::Tensor sequence_weights(const PreparedObjective& prepared) const;
  // The normaliser of each scored token of the head chunk at `start` whose scored mask is `mask` ([B, c], in the
  // log-probs' dtype): sequence_weights of each position's sequence, [B, c] (or [B, 1] for unpacked rows).
  virtual at::Tensor token_weights(const PreparedObjective& prepared, const at::Tensor& mask, std::int64_t start) const;
  at::Tensor row_statistics(const PreparedObjective& prepared, const at::Tensor& logp, std::int64_t start) const override;
  // What the hooks read: completion tokens of each sequence [n] (n_s), the row holding each sequence [n] int64, and
  // per position [B, T] int64 the sequence it belongs to (undefined for unpacked rows: the row itself).
  const at::Tensor& sequence_counts(const PreparedObjective& prepared) const;
  const at::Tensor& row_of_sequence(const PreparedObjective& prepared) const;
  const at::Tensor& sequence_of_position(const PreparedObjective& prepared) const;
  // [B, c] (or [B, 1] unpacked) of per-sequence `values` [n] at positions [start, start + like.size(1)), in like's dtype.
  at::Tensor per_position(const PreparedObjective& prepared, const at::Tensor& values, std::int64_t start,
                          const at::Tensor& like) const;

 private:
  struct State;
  Fields prepare_fields(const Batch& batch, const ModelConfig& config, const std::optional<StepTotals>& step_totals,
                        const std::string& source) const override;
  at::Tensor token_loss(const PreparedObjective& prepared, const at::Tensor& logp, std::int64_t start) const override;
  at::Tensor row_loss(const PreparedObjective& prepared, const at::Tensor& S) const override;
  at::Tensor clipped_surrogate(const at::Tensor& w, const at::Tensor& advantages) const;  // -min(w·A, clip(w)·A)

  Options options_;
};

// Packed GRPO rows of the given lengths per row (each row's summing to T), seeded: random tokens, each sequence one
// completion whose prompt is its first round(F·L) tokens, F = prompt_fraction or (0) drawn in [0, 1/2) per sequence
// (at least 1 token; a sequence of one token has no completion),
// one advantage per sequence in cu_seqlens order, group-normalised over `group` consecutive sequences (0: all of
// them; the last group takes the remainder, a remainder of one joining the group before it; a lone sequence keeps its
// raw N(0, 1) reward).
Batch packed_grpo_batch(const ModelConfig& config, const std::vector<std::vector<std::int64_t>>& lengths,
                        std::int64_t group, std::uint64_t seed, double prompt_fraction = 0.0);

}  // namespace sbp
