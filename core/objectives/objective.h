// Training objectives, one code path for every BP method (ARCHITECTURE.md §5). Every objective here is a function of the
// per-token log-probabilities logp[b, t] = log_softmax(logits[b, t] / temperature)[target[b, t]] of the tokens it
// scores (position t predicts token t + 1), in two parts:
//   L = sum over tokens of token terms (SFT's NLL, GRPO's clipped surrogate and KL)
//     + R(S), S[b] = a sum over the tokens of row b (DPO's log-prob sums, GRPO's sequence-level log-ratio).
// A method feeds the objective the logits of chunks of positions; the chunk terms sum to L and their gradients to
// dL/dlogits. Counts and normalisers are fixed in prepare(). R couples positions through S: a method that streams
// the head over several chunks first runs the statistics pass (no grad) that sums S over the whole sequence, and
// each chunk then differentiates R(S_rest + S_chunk) with S_rest = S - S_chunk held fixed: that is exactly
// dR/dS(S) · dS_chunk/dlogits, the fixed-coefficient pass 2 of ARCHITECTURE.md §5. A chunk that is the whole sequence
// (standard, checkpoint) needs no pass: R is then differentiated as written.
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

class Objective {
 public:
  virtual ~Objective() = default;
  // Canonical spec with every option; make_objective(spec()) builds the same objective.
  virtual std::string spec() const = 0;
  std::string name() const { return spec().substr(0, spec().find(':')); }
  double temperature() const { return temperature_; }

  // Validates the objective's tensors in `batch` (Throws InputError naming `source` and the tensor) and
  // fixes everything that couples positions: targets, counts, normalisers. Forgets earlier statistics.
  void prepare(const Batch& batch, const ModelConfig& config, const std::string& source = "batch");

  // The statistics pass, for methods whose head chunks do not cover the sequence at once: when needs_statistics(),
  // call accumulate_statistics on every chunk of [0, T) (no grad; it may overwrite `logits`), then chunk terms.
  bool needs_statistics() const { return has_row_term() && !statistics_ready_; }
  void accumulate_statistics(at::Tensor& logits, std::int64_t start);  // logits: [B, c, V] of positions [start, start+c)
  // On a sequence-parallel rank each rank saw only its own positions: `group_sum` sums the statistics over the group
  // in place first (KVSource::sum_over_group), so that every rank holds the whole sequence's S.
  void finish_statistics(const std::function<void(at::Tensor&)>& group_sum = {});

  // logits: [B, c, V] for positions [start, start + c), in compute dtype. Returns the 0-dim chunk term, with a graph.
  at::Tensor chunk_loss(const at::Tensor& logits, std::int64_t start) const;
  // The chunk term's value, with `logits` overwritten by dTerm/dlogits in place: one [B, c, V] buffer at the peak
  // instead of autograd's three. Only the [B, c] log-probs go through autograd (the objective's formula); the
  // softmax part of the chain rule, (onehot - softmax) * dL/dlogp / temperature, is written into the logits.
  double chunk_loss_and_grad(at::Tensor& logits, std::int64_t start) const;
  // The same by autograd through chunk_loss (two more [B, c, V] buffers): the reference the in-place one is tested on.
  double chunk_loss_and_grad_by_autograd(at::Tensor& logits, std::int64_t start) const;

  // The totals of the batch last prepared.
  StepTotals batch_totals() const;
  // Normalise by these totals instead of each batch's own, across prepare() calls until reset (nullopt): the
  // micro-batches of one optimizer step share the step's totals, as HF/TRL's num_items_in_batch, so that K
  // micro-batches of B give exactly the gradient of one batch of K*B (sums over rows, each divided by the whole).
  void set_step_totals(std::optional<StepTotals> totals) { step_totals_ = totals; }
  // The batch's rows cut into `parts` micro-batches of equal size (Throws InputError naming `source` when
  // they do not divide); DPO keeps each chosen row with its rejected one.
  virtual std::vector<Batch> split(const Batch& batch, std::int64_t parts, const std::string& source) const;
  // The batch's rows as the given micro-batches (micro_batch_rows_problem's rules; Throws InputError naming `source`).
  std::vector<Batch> micro_batches(const Batch& batch, const MicroBatchRows& rows, const std::string& source) const;
  // A row of the first half and its partner in the second make one example (DPO's chosen and rejected rows): a
  // micro-batch never separates them.
  virtual bool paired_rows() const { return false; }

  // Bytes per position of what prepare() keeps for the step (the memory models' "objective buffers").
  virtual std::int64_t buffer_bytes_per_token() const { return 16; }  // targets (int64) + scored mask (fp64)

  // Random batches of this objective's format (--batch/--seq): tokens, masks and the objective's own tensors.
  virtual Batch random_batch(const ModelConfig& config, const RandomBatchOptions& options) const = 0;
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
  // Set by prepare_fields: targets [B, T] int64 (the token position t is scored on, -1 where none) and the
  // temperature dividing the logits.
  virtual void prepare_fields(const Batch& batch, const ModelConfig& config, const std::string& source) = 0;
  // The token part of the loss on a chunk: logp [B, c] (0 where unscored) of positions [start, start + c).
  virtual at::Tensor token_loss(const at::Tensor& logp, std::int64_t start) const = 0;
  // The row part: S_chunk [B] from a chunk's log-probs, and R(S) (0-dim; chunk_term passes S in fp64). Only with
  // has_row_term().
  virtual bool has_row_term() const { return false; }
  virtual at::Tensor row_statistics(const at::Tensor& logp, std::int64_t start) const;
  virtual at::Tensor row_loss(const at::Tensor& S) const;

  // The normalisers in effect: the step's totals when set, else the batch's own count.
  double rows_normaliser(std::int64_t batch_rows) const {
    return double(step_totals_ ? step_totals_->rows : batch_rows);
  }
  double tokens_normaliser(double batch_tokens) const {
    return step_totals_ ? double(step_totals_->tokens) : batch_tokens;
  }

  // The chunk's terms as a function of its log-probs: token terms + R(S_rest + S_chunk) (see the top of this file).
  at::Tensor chunk_term(const at::Tensor& logp, std::int64_t start) const;
  // S_rest of that chunk term, held fixed: the other chunks' share of the statistics, total - S_chunk (both [B]).
  virtual at::Tensor statistics_rest(const at::Tensor& total, const at::Tensor& s_chunk) const;
  // Log-probs of the chunk's targets, [B, c], 0 where unscored; differentiable (log_softmax) or, in place, leaving
  // exp(logits / temperature - row max) in `logits` and, when asked, its row sums ([B*c, 1]) in `row_sum`.
  at::Tensor logps(const at::Tensor& logits, std::int64_t start) const;
  at::Tensor logps_in_place(at::Tensor& logits, std::int64_t start, at::Tensor* row_sum = nullptr) const;
  // Rows of the in-place head processed together: about a cache's worth (see logps_in_place).
  static constexpr std::int64_t kHeadBlockBytes = std::int64_t(2) << 20;
  // [B, c] slice of a [B, T] per-position tensor, as `like`'s dtype.
  static at::Tensor chunk_of(const at::Tensor& per_position, std::int64_t start, const at::Tensor& like);

  at::Tensor targets_;  // [B, T] int64, -1 = position not scored
  at::Tensor scored_;   // [B, T] fp64, 1 where targets_ >= 0
  double temperature_ = 1.0;
  std::int64_t seq_len_ = 0;
  at::Tensor statistics_;  // [B] fp64: S summed over the chunks seen by the statistics pass
  bool statistics_ready_ = false;
  std::optional<StepTotals> step_totals_;
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

// Shifted per-position view of a per-token tensor: out[:, t] = x[:, t + 1], the last column `fill`. Position t
// predicts token t + 1, so a token's mask or log-prob is read at the position before it.
at::Tensor shift_left(const at::Tensor& per_token, double fill);

// "sft", "grpo:beta=0.04,...", "dpo:beta=0.1,label_smoothing=0", from the catalogue (catalogue.h): Throws
// InputError naming the unknown objective, key or bad value.
std::unique_ptr<Objective> make_objective(const std::string& spec);

}  // namespace sbp
