#include "core/objectives/dpo.h"

#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include "core/io/input_error.h"

namespace sbp {

// What DPO keeps of a batch besides its targets.
struct DpoObjective::State final : ObjectiveState {
  at::Tensor ref;  // [2P] fp64: the reference's log-prob sums
  // The step's pairs when normalised by the step's totals; none: the mean over the batch's own pairs.
  std::optional<double> step_pairs;
};

DpoObjective::DpoObjective(const Spec& spec) {
  spec.check_keys({"beta", "label_smoothing"});
  options_.beta = spec.get_double("beta", options_.beta, 0.0, 1e6);
  options_.label_smoothing = spec.get_double("label_smoothing", options_.label_smoothing, 0.0, 0.5);
}

std::string DpoObjective::spec() const {
  return fmt::format("dpo:beta={},label_smoothing={}", options_.beta, options_.label_smoothing);
}

std::string DpoObjective::packed_rows_refusal() const {
  return "dpo: packed rows (position_ids / cu_seqlens) are not defined for it: a pair's chosen and rejected sequences "
         "would have to be matched across packs (its loss couples row p with row P + p, and no packed layout says which "
         "sequence pairs with which); give each its own right-padded row (the chosen rows, then the rejected ones)";
}

Batch DpoObjective::random_batch(const ModelConfig& config, const RandomBatchOptions& o) const {
  if (o.pack.packed()) throw InputError(packed_rows_refusal());
  if (o.batch_size % 2 != 0)
    throw InputError("dpo: --batch counts rows (P chosen, then P rejected) and must be even, got " +
                                std::to_string(o.batch_size));
  const auto P = o.batch_size / 2;
  std::vector<std::int64_t> prompt_of_row(o.batch_size);
  for (std::int64_t r = 0; r < o.batch_size; ++r) prompt_of_row[r] = r % P;
  return random_completion_batch(config, o, prompt_of_row);
}

void DpoObjective::add_synthetic_logps(Batch& batch, const at::Tensor& token_logps, std::uint64_t seed,
                                       bool reference_given) const {
  if (reference_given) return;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed + 3);
  const auto policy = token_logps.to(at::kDouble);
  const auto noisy = policy + at::normal(0.0, 0.3, policy.sizes(), gen, at::kDouble).to(policy.device());  // CPU draw, as on every device
  batch.fields["ref_logps"] = (noisy * batch.field("completion_mask").to(at::kDouble)).sum(1);
}

Batch DpoObjective::with_reference(const Batch& batch, const at::Tensor& token_logps) const {
  Batch out = batch;
  out.fields["ref_logps"] = (token_logps.to(at::kDouble) * batch.field("completion_mask").to(at::kDouble)).sum(1);
  return out;
}

std::vector<Batch> DpoObjective::split(const Batch& batch, std::int64_t parts, const std::string& source) const {
  const auto P = batch.batch_size() / 2;
  if (batch.batch_size() % 2 != 0 || parts < 1 || P % parts != 0)
    throw InputError(source + ": dpo's " + std::to_string(P) + " pairs (" +
                                std::to_string(batch.batch_size()) + " rows) do not split into " +
                                std::to_string(parts) + " equal micro-batches of whole pairs");
  std::vector<Batch> out;
  const auto n = P / parts;
  for (std::int64_t k = 0; k < parts; ++k) {
    const auto chosen = at::arange(k * n, (k + 1) * n);
    out.push_back(batch.select_rows(at::cat({chosen, chosen + P})));
  }
  return out;
}

Objective::Fields DpoObjective::prepare_fields(const Batch& b, const ModelConfig&,
                                               const std::optional<StepTotals>& step_totals,
                                               const std::string& source) const {
  check_field_names(b, {"completion_mask"}, {"ref_logps"}, "dpo", source);
  const auto rows = b.batch_size();
  if (rows % 2 != 0)
    throw InputError(source + ": dpo needs an even number of rows (P chosen, then P rejected), input_ids has " +
                                std::to_string(rows));
  const auto completion = checked_completion_mask(b, source);
  if (!b.has("ref_logps"))
    throw InputError(source + ": dpo needs ref_logps in the batch or --ref (a reference model)");
  auto state = std::make_shared<State>();
  state->ref = checked_float_field(b, "ref_logps", {rows}, {}, source);
  if (step_totals) state->step_pairs = rows_normaliser(step_totals, rows) / 2;
  Fields fields;
  fields.targets = at::where(shift_left(completion, 0) == 1, shift_left(b.input_ids, 0), -1);
  fields.state = std::move(state);
  return fields;
}

at::Tensor DpoObjective::token_loss(const PreparedObjective&, const at::Tensor& logp, std::int64_t) const {
  return at::zeros({}, logp.options());  // the whole loss is the row term
}

at::Tensor DpoObjective::row_statistics(const PreparedObjective&, const at::Tensor& logp, std::int64_t) const {
  return logp.sum(1);  // [2P]; logp is 0 on unscored positions
}

at::Tensor DpoObjective::row_loss(const PreparedObjective& prepared, const at::Tensor& S) const {
  const auto& state = prepared.state<State>();
  const auto P = S.size(0) / 2;
  const auto ratios = S - state.ref.to(S.scalar_type());  // log pi/ref per row
  const auto z = options_.beta * (ratios.slice(0, 0, P) - ratios.slice(0, P));
  const double ls = options_.label_smoothing;
  // The mean over pairs, or over the step's pairs when the micro-batches of one step share its totals.
  const auto losses = -(1.0 - ls) * at::log_sigmoid(z) - ls * at::log_sigmoid(-z);
  return state.step_pairs ? losses.sum() / *state.step_pairs : losses.mean();
}

}  // namespace sbp
