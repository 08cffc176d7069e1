// Training objectives, one code path for every BP method (ARCHITECTURE.md §5). Every objective here is a function of the
// per-token log-probabilities logp[b, t] = log_softmax(logits[b, t] / temperature)[target[b, t]] of the tokens it
// scores (position t predicts token t + 1), in two parts:
//   L = sum over tokens of token terms (SFT's NLL, GRPO's clipped surrogate and KL)
//     + R(S), S[b] = a sum over the tokens of row b (DPO's log-prob sums, GRPO's sequence-level log-ratio); of packed
//       rows, S[s] sums over sequence s instead (cu_seqlens order), as GRPO defines it (docs/packing.md).
// An Objective is the formula and its options, fixed at construction. prepare() checks a batch and returns a
// PreparedObjective holding everything that couples positions (targets, counts, normalisers), which never changes.
// A method feeds the prepared objective the logits of chunks of positions; the chunk terms sum to L and their
// gradients to dL/dlogits. R couples positions through S: a method that streams the head over several chunks first
// runs the statistics pass (StatisticsPass, no grad), which sums S over the whole sequence and returns the prepared
// objective completed with it; each chunk then differentiates R(S_rest + S_chunk) with S_rest = S - S_chunk held
// fixed: that is exactly dR/dS(S) · dS_chunk/dlogits, the fixed-coefficient pass 2 of ARCHITECTURE.md §5. A chunk that
// is the whole sequence (standard, checkpoint) needs no pass: R is then differentiated as written.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include <ATen/core/Tensor.h>

#include "core/objectives/batch.h"
#include "core/model/config.h"
#include "core/io/input_error.h"

namespace sbp {

// What an objective normalises by: rows (GRPO's grpo and dr_grpo losses; DPO's pairs are rows / 2) and scored
// tokens (SFT; GRPO's bnpo and dapo).
struct StepTotals {
  std::int64_t rows = 0, tokens = 0;
};

class Objective;

// What an objective keeps of one batch besides its targets (GRPO's advantages and old/ref log-probs, DPO's reference
// sums): each objective's own subclass, which its formula reads back with PreparedObjective::state.
struct ObjectiveState {
  virtual ~ObjectiveState() = default;
};

// An objective prepared on one batch (Objective::prepare): targets, scored mask, normalisers, the objective's own
// tensors and, once known, the row statistics S, all fixed at construction. It is what a method's step works on, for
// that step; it refers to its Objective, which outlives it. A copy shares the tensors.
class PreparedObjective {
 public:
  const Objective& objective() const { return *objective_; }
  double temperature() const { return temperature_; }
  // The batch's own totals (rows, scored tokens), whatever normalisers it was prepared with. Of packed rows, "rows"
  // counts the sequences: what GRPO's grpo and dr_grpo normalise by (one completion per packed sequence).
  StepTotals batch_totals() const;
  // Bytes per position of what it keeps (the memory models' "objective buffers").
  std::int64_t buffer_bytes_per_token() const { return buffer_bytes_per_token_; }
  // Whether a head chunk that is not the whole sequence needs the statistics pass first: a row term whose S is not
  // known yet (StatisticsPass makes the prepared objective that knows it).
  bool needs_statistics() const;

  // logits: [B, c, V] for positions [start, start + c), in compute dtype. Returns the 0-dim chunk term, with a graph.
  at::Tensor chunk_loss(const at::Tensor& logits, std::int64_t start) const;
  // The chunk term's value, with `logits` overwritten by dTerm/dlogits in place: one [B, c, V] buffer at the peak
  // instead of autograd's three. Only the [B, c] log-probs go through autograd (the objective's formula); the
  // softmax part of the chain rule, (onehot - softmax) * dL/dlogp / temperature, is written into the logits.
  double chunk_loss_and_grad(at::Tensor& logits, std::int64_t start) const;
  // The same by autograd through chunk_loss (two more [B, c, V] buffers): the reference the in-place one is tested on.
  double chunk_loss_and_grad_by_autograd(at::Tensor& logits, std::int64_t start) const;

  // What the objectives' formulas read.
  const at::Tensor& targets() const { return targets_; }  // [B, T] int64, -1 = position not scored
  const at::Tensor& scored() const { return scored_; }    // [B, T] fp64, 1 where targets >= 0
  // The objective's own state, as the subclass its prepare_fields made (std::bad_cast for another).
  template <class State>
  const State& state() const {
    return dynamic_cast<const State&>(*state_);
  }

 private:
  friend class Objective;
  friend class StatisticsPass;
  PreparedObjective(const Objective& objective, const Batch& batch, at::Tensor targets,
                    std::shared_ptr<const ObjectiveState> state, std::int64_t state_bytes_per_token,
                    bool statistics_known);

  // The chunk's terms as a function of its log-probs: token terms + R(S_rest + S_chunk) (see the top of this file).
  at::Tensor chunk_term(const at::Tensor& logp, std::int64_t start) const;
  // Log-probs of the chunk's targets, [B, c], 0 where unscored; differentiable (log_softmax) or, in place, leaving
  // exp(logits / temperature - row max) in `logits` and, when asked, its row sums ([B*c, 1]) in `row_sum`.
  at::Tensor logps(const at::Tensor& logits, std::int64_t start) const;
  at::Tensor logps_in_place(at::Tensor& logits, std::int64_t start, at::Tensor* row_sum = nullptr) const;
  // Rows of the in-place head processed together: about a cache's worth (see logps_in_place).
  static constexpr std::int64_t kHeadBlockBytes = std::int64_t(2) << 20;

  const Objective* objective_;
  at::Tensor targets_;  // [B, T] int64
  at::Tensor scored_;   // [B, T] fp64
  double temperature_ = 1.0;
  std::int64_t seq_len_ = 0;
  std::int64_t buffer_bytes_per_token_ = 0;
  std::shared_ptr<const ObjectiveState> state_;
  std::int64_t sequences_ = 0;  // the row statistics' count: rows, or packed rows' sequences
  at::Tensor statistics_;  // [sequences_] fp64: S over the whole sequence; undefined while unknown
};

// Pass 1 of ARCHITECTURE.md §5, for a prepared objective that needs_statistics(): S summed over head chunks that
// cover [0, T) (no grad), then the prepared objective completed with it, a new object.
class StatisticsPass {
 public:
  explicit StatisticsPass(const PreparedObjective& objective);
  // logits: [B, c, V] of positions [start, start + c); overwritten (the in-place log-softmax).
  void add(at::Tensor& logits, std::int64_t start);
  // Once, after the last chunk. On a sequence-parallel rank each rank saw only its own positions: `group_sum` first
  // sums S over the group in place (KVSource::sum_over_group), so that every rank holds the whole sequence's S.
  PreparedObjective finish(const std::function<void(at::Tensor&)>& group_sum = {});

 private:
  const PreparedObjective& objective_;
  at::Tensor sums_;  // [B] fp64 (packed rows: [sequences])
};

class Objective {
 public:
  virtual ~Objective() = default;
  // Canonical spec with every option; make_objective(spec()) builds the same objective.
  virtual std::string spec() const = 0;
  std::string name() const { return spec().substr(0, spec().find(':')); }
  // Divides the logits before the log-softmax.
  virtual double temperature() const { return 1.0; }

  // Checks the objective's tensors in `batch` (Throws InputError naming `source` and the tensor) and fixes what
  // couples positions. Normalised by `step_totals` when given, else by the batch's own counts: the micro-batches of
  // one optimizer step share the step's totals, as HF/TRL's num_items_in_batch, so that K micro-batches of B give
  // exactly the gradient of one batch of K*B (sums over rows, each divided by the whole).
  PreparedObjective prepare(const Batch& batch, const ModelConfig& config,
                            const std::optional<StepTotals>& step_totals = std::nullopt,
                            const std::string& source = "batch") const;
  // Why this objective cannot take packed rows (Batch::packed), or "" when it can: prepare() refuses them with it.
  // A packed layout must say what each per-row statistic means per sequence: defined for SFT and GRPO, not DPO.
  virtual std::string packed_rows_refusal() const;
  // Whether the loss has a row term R(S): a streamed head then runs the statistics pass, unless the batch gives S
  // without one (PreparedObjective::needs_statistics). What a workload without a batch (a projection) assumes.
  virtual bool has_row_term() const { return false; }
  // Bytes per position every prepared batch keeps: targets (int64) + scored mask (fp64). A batch's own per-position
  // tensors (GRPO's old/ref log-probs) come on top: PreparedObjective::buffer_bytes_per_token.
  static constexpr std::int64_t kTargetBytesPerToken = 16;

  // The batch's rows cut into `parts` micro-batches of equal size (Throws InputError naming `source` when
  // they do not divide); DPO keeps each chosen row with its rejected one.
  virtual std::vector<Batch> split(const Batch& batch, std::int64_t parts, const std::string& source) const;
  // The batch's rows as the given micro-batches (micro_batch_rows_problem's rules; Throws InputError naming `source`).
  std::vector<Batch> micro_batches(const Batch& batch, const MicroBatchRows& rows, const std::string& source) const;
  // A row of the first half and its partner in the second make one example (DPO's chosen and rejected rows): a
  // micro-batch never separates them.
  virtual bool paired_rows() const { return false; }

  // Random batches of this objective's format (--batch/--seq): tokens, masks and the objective's own tensors.
  virtual Batch random_batch(const ModelConfig& config, const RandomBatchOptions& options) const = 0;
  // The prompt_fraction of the random batches the commands make (RandomBatchOptions): 0 lets GRPO and DPO draw
  // their prompts; SFT masks a leading share of labels, so that its checks see masked targets.
  virtual double default_prompt_fraction() const { return 0.0; }
  // Log-probs a random batch synthesises from the policy's (old_logps, and ref_logps when no reference model is
  // given): when true, the caller computes the policy's per-token log-probs and calls add_synthetic_logps.
  virtual bool wants_policy_logps() const { return false; }
  // token_logps: [B, T], column t = log-prob of token t under the policy (sequence_logps). Seeded perturbations.
  virtual void add_synthetic_logps(Batch& batch, const at::Tensor& token_logps, std::uint64_t seed,
                                   bool reference_given) const;
  // True when the loss needs reference log-probs that `batch` does not carry: they come from --ref.
  virtual bool needs_reference(const Batch& batch) const { return false; }
  // The batch with ref_logps computed from the reference model's per-token log-probs ([B, T], as above).
  virtual Batch with_reference(const Batch& batch, const at::Tensor& token_logps) const;

 protected:
  // What prepare_fields fixes of a batch.
  struct Fields {
    at::Tensor targets;  // [B, T] int64: the token position t is scored on, -1 where none
    std::shared_ptr<const ObjectiveState> state;  // the objective's own tensors (null: none)
    std::int64_t state_bytes_per_token = 0;       // of the state's per-position tensors
    bool statistics_known = false;                // a row term's S is 0 in value, known before any chunk
  };
  // Checks the batch's tensors and fixes the objective's fields, normalised as prepare() says.
  virtual Fields prepare_fields(const Batch& batch, const ModelConfig& config,
                                const std::optional<StepTotals>& step_totals, const std::string& source) const = 0;
  // The token part of the loss on a chunk: logp [B, c] (0 where unscored) of positions [start, start + c).
  virtual at::Tensor token_loss(const PreparedObjective& prepared, const at::Tensor& logp, std::int64_t start) const = 0;
  // The row part: S_chunk [B] (packed rows: [sequences]) from a chunk's log-probs, and R(S) (0-dim; the chunk term passes S in fp64). Only with
  // has_row_term().
  virtual at::Tensor row_statistics(const PreparedObjective& prepared, const at::Tensor& logp, std::int64_t start) const;
  virtual at::Tensor row_loss(const PreparedObjective& prepared, const at::Tensor& S) const;
  // S_rest of a chunk term, held fixed: the other chunks' share of the statistics, total - S_chunk (both [B]).
  virtual at::Tensor statistics_rest(const at::Tensor& total, const at::Tensor& s_chunk) const;

  // The normalisers in effect: the step's totals when given, else the batch's own count.
  static double rows_normaliser(const std::optional<StepTotals>& step_totals, std::int64_t batch_rows) {
    return double(step_totals ? step_totals->rows : batch_rows);
  }
  static double tokens_normaliser(const std::optional<StepTotals>& step_totals, double batch_tokens) {
    return step_totals ? double(step_totals->tokens) : batch_tokens;
  }

 private:
  friend class PreparedObjective;
  friend class StatisticsPass;
};

// Checks shared by the objectives' prepare_fields; each Throws InputError naming `source` and the tensor.
// Every tensor of the batch is in required or optional (an unexpected one means the batch was made for another
// objective), and every required one is there.
void check_field_names(const Batch& batch, const std::set<std::string>& required, const std::set<std::string>& optional,
                       const std::string& objective, const std::string& source);
// completion_mask: int64 [B, T] of 0/1, never on a pad or on token 0 (nothing predicts it), and not all zero.
at::Tensor checked_completion_mask(const Batch& batch, const std::string& source);
// A floating tensor of exactly `shape` with finite values where `where` (same shape; undefined: everywhere), as fp64.
at::Tensor checked_float_field(const Batch& batch, const std::string& name, at::IntArrayRef shape,
                               const at::Tensor& where, const std::string& source);

// A packed batch's targets never cross a sequence boundary: the last position of a sequence predicts nothing (the
// next sequence's first label is -100, DataCollatorWithFlattening's separator). `targets` [B, T] as prepare_fields
// makes them (-1: none). Throws InputError naming `source`, the row, the position and `field`'s entry there.
void check_targets_within_sequences(const Batch& batch, const at::Tensor& targets, const std::string& field,
                                    const std::string& source);
// Shifted per-position view of a per-token tensor: out[:, t] = x[:, t + 1], the last column `fill`. Position t
// predicts token t + 1, so a token's mask or log-prob is read at the position before it.
at::Tensor shift_left(const at::Tensor& per_token, double fill);
// [B, c] slice of a [B, T] per-position tensor for the chunk at `start` whose log-probs are `like`, in their dtype.
at::Tensor chunk_of(const at::Tensor& per_position, std::int64_t start, const at::Tensor& like);

// "sft", "grpo:beta=0.04,...", "dpo:beta=0.1,label_smoothing=0", from the catalogue (catalogue.h): Throws
// InputError naming the unknown objective, key or bad value.
std::unique_ptr<Objective> make_objective(const std::string& spec);

}  // namespace sbp
