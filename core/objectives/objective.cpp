#include "core/objectives/objective.h"

#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include "core/io/spec.h"
#include "core/io/input_error.h"

namespace sbp {
namespace {

void check_batch(bool ok, const std::string& source, const std::string& what) {
  if (!ok) throw InputError(source + ": " + what);
}

std::string join_names(const std::set<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out.empty() ? "none" : out;
}

}  // namespace

void check_field_names(const Batch& batch, const std::set<std::string>& required, const std::set<std::string>& optional,
                       const std::string& objective, const std::string& source) {
  for (const auto& name : required)
    check_batch(batch.has(name), source, "missing tensor '" + name + "' (objective " + objective + " needs " + join_names(required) + ")");
  for (const auto& [name, tensor] : batch.fields)
    check_batch(required.count(name) || optional.count(name), source,
                "unexpected tensor '" + name + "' for objective " + objective + " (it reads " + join_names(required) +
                    (optional.empty() ? "" : "; optional " + join_names(optional)) + "): was the batch made for another objective?");
}

at::Tensor checked_completion_mask(const Batch& b, const std::string& source) {
  const auto& m = b.field("completion_mask");
  check_batch(m.scalar_type() == at::kLong, source, "completion_mask must be int64, got " + std::string(c10::toString(m.scalar_type())));
  check_batch(m.sizes() == b.input_ids.sizes(), source,
              "completion_mask " + c10::str(m.sizes()) + " must have the shape of input_ids " + c10::str(b.input_ids.sizes()));
  check_batch(((m == 0) | (m == 1)).all().item<bool>(), source, "completion_mask must hold only 0 and 1");
  check_batch(((m == 0) | (b.attention_mask == 1)).all().item<bool>(), source,
              "completion_mask is 1 on a padded position (attention_mask 0): a pad is never scored");
  check_batch((m.select(1, 0) == 0).all().item<bool>(), source,
              "completion_mask is 1 on token 0, which no position predicts: a completion follows at least one prompt token");
  check_batch(m.any().item<bool>(), source, "completion_mask is all 0: the batch has no completion token to score");
  return m;
}

at::Tensor checked_float_field(const Batch& b, const std::string& name, at::IntArrayRef shape, const at::Tensor& where,
                               const std::string& source) {
  const auto& t = b.field(name);
  check_batch(at::isFloatingType(t.scalar_type()), source, name + " must be floating point, got " + std::string(c10::toString(t.scalar_type())));
  check_batch(t.sizes() == shape, source, name + " has shape " + c10::str(t.sizes()) + ", expected " + c10::str(shape));
  const auto x = t.to(at::kDouble);
  const auto finite = at::isfinite(x);
  check_batch((where.defined() ? (finite | (where == 0)) : finite).all().item<bool>(), source, name + " holds a non-finite value");
  return where.defined() ? x.masked_fill(where == 0, 0.0) : x;
}

void check_targets_within_sequences(const Batch& b, const at::Tensor& targets, const std::string& field,
                                    const std::string& source) {
  if (!b.packed) return;
  const auto scored = (targets >= 0).to(at::kCPU);
  const auto a = scored.accessor<bool, 2>();
  for (std::int64_t r = 0; r < b.packed->rows(); ++r)
    for (const auto start : b.packed->starts(r))
      if (start > 0 && a[r][start - 1])
        throw InputError(source + ": row " + std::to_string(r) + ", position " + std::to_string(start) + ": " + field +
                         " there is a target across a sequence boundary (the sequence ending at position " +
                         std::to_string(start - 1) + " would be trained to predict the next one's first token); a "
                         "packed row's first label of each sequence is -100 (DataCollatorWithFlattening's separator)");
}

at::Tensor shift_left(const at::Tensor& x, double fill) {
  return at::cat({x.slice(1, 1), at::full({x.size(0), 1}, fill, x.options())}, 1);
}

at::Tensor chunk_of(const at::Tensor& per_position, std::int64_t start, const at::Tensor& like) {
  return per_position.slice(1, start, start + like.size(1)).to(like.scalar_type());
}

std::string Objective::packed_rows_refusal() const {
  return name() + ": packed rows (position_ids / cu_seqlens) are not defined for this objective yet; give each "
                  "sequence its own right-padded row";
}

PreparedObjective Objective::prepare(const Batch& batch, const ModelConfig& config,
                                     const std::optional<StepTotals>& step_totals, const std::string& source) const {
  if (batch.packed)
    if (const auto why = packed_rows_refusal(); !why.empty()) throw InputError(source + ": " + why);
  auto fields = prepare_fields(batch, config, step_totals, source);
  return PreparedObjective(*this, batch, std::move(fields.targets), std::move(fields.state),
                           fields.state_bytes_per_token, fields.statistics_known);
}

PreparedObjective::PreparedObjective(const Objective& objective, const Batch& batch, at::Tensor targets,
                                     std::shared_ptr<const ObjectiveState> state, std::int64_t state_bytes_per_token,
                                     bool statistics_known)
    : objective_(&objective),
      targets_(std::move(targets)),
      temperature_(objective.temperature()),
      seq_len_(batch.seq_len()),
      buffer_bytes_per_token_(Objective::kTargetBytesPerToken + state_bytes_per_token),
      state_(std::move(state)),
      sequences_(batch.packed ? batch.packed->sequences() : batch.batch_size()) {
  TORCH_CHECK(targets_.defined() && targets_.sizes() == batch.input_ids.sizes(), "objective set no [B, T] targets");
  scored_ = (targets_ >= 0).to(at::kDouble);
  // Known without a pass (GRPO's sequence ratio without old_logps): S is 0 in value.
  if (objective.has_row_term() && statistics_known)
    statistics_ = at::zeros({sequences_}, batch.input_ids.options().dtype(at::kDouble));
}

bool PreparedObjective::needs_statistics() const { return objective_->has_row_term() && !statistics_.defined(); }

StepTotals PreparedObjective::batch_totals() const {
  return {sequences_, static_cast<std::int64_t>(scored_.sum().item<double>())};
}

std::vector<Batch> Objective::split(const Batch& batch, std::int64_t parts, const std::string& source) const {
  const auto rows = batch.batch_size();
  if (parts < 1 || rows % parts != 0)
    throw InputError(source + ": " + std::to_string(rows) + " rows do not split into " +
                                std::to_string(parts) + " equal micro-batches");
  std::vector<Batch> out;
  const auto n = rows / parts;
  for (std::int64_t k = 0; k < parts; ++k) out.push_back(batch.select_rows(at::arange(k * n, (k + 1) * n)));
  return out;
}

std::vector<Batch> Objective::micro_batches(const Batch& batch, const MicroBatchRows& rows,
                                            const std::string& source) const {
  if (const auto problem = micro_batch_rows_problem(rows, batch.batch_size(), paired_rows()); !problem.empty())
    throw InputError(source + ": " + problem);
  std::vector<Batch> out;
  for (const auto& r : rows) out.push_back(batch.select_rows(at::tensor(r, at::TensorOptions().dtype(at::kLong))));
  return out;
}

at::Tensor PreparedObjective::logps(const at::Tensor& logits, std::int64_t start) const {
  const auto c = logits.size(1);
  const auto targets = targets_.slice(1, start, start + c).clamp_min(0).unsqueeze(-1);  // [B, c, 1]
  const auto scaled = temperature_ == 1.0 ? logits : logits / temperature_;
  const auto logp = at::log_softmax(scaled, -1).gather(-1, targets).squeeze(-1);  // [B, c]
  return logp * chunk_of(scored_, start, logp);
}

at::Tensor PreparedObjective::logps_in_place(at::Tensor& logits, std::int64_t start, at::Tensor* row_sum) const {
  at::NoGradGuard no_grad;
  TORCH_CHECK(logits.is_contiguous(), "the in-place head needs contiguous [B, c, V] logits");
  const auto B = logits.size(0), c = logits.size(1), V = logits.size(2), N = B * c;
  auto x = logits.view({N, V});
  const auto targets = targets_.slice(1, start, start + c).clamp_min(0).reshape({N, 1});
  auto picked = at::empty({N, 1}, x.options()), row_max = at::empty({N, 1}, x.options()),
       sums = at::empty({N, 1}, x.options());
  // x <- exp(x / temperature - max), a few rows at a time: each row's passes (scale, max, exp, sum) then run in cache
  // instead of streaming the whole [N, V] buffer through memory once per pass (3x faster on qwen3-small's head).
  const auto rows = std::max<std::int64_t>(1, kHeadBlockBytes / (V * std::int64_t(x.element_size())));
  for (std::int64_t r = 0; r < N; r += rows) {
    const auto n = std::min(rows, N - r);
    auto y = x.narrow(0, r, n);
    if (temperature_ != 1.0) y.div_(temperature_);
    auto m = row_max.narrow(0, r, n), s = sums.narrow(0, r, n), p = picked.narrow(0, r, n);
    at::gather_out(p, y, 1, targets.narrow(0, r, n));  // the target logit, before y is overwritten
    at::amax_out(m, y, {1}, /*keepdim=*/true);
    y.sub_(m).exp_();
    at::sum_out(s, y, {1}, /*keepdim=*/true);
  }
  const auto logp = (picked - row_max - sums.log()).view({B, c});
  if (row_sum != nullptr) *row_sum = sums;
  return logp * chunk_of(scored_, start, logp);
}

at::Tensor Objective::row_statistics(const PreparedObjective&, const at::Tensor&, std::int64_t) const {
  throw std::logic_error(name() + ": no row statistics");
}

at::Tensor Objective::row_loss(const PreparedObjective&, const at::Tensor&) const {
  throw std::logic_error(name() + ": no row term");
}

at::Tensor PreparedObjective::chunk_term(const at::Tensor& logp, std::int64_t start) const {
  const auto& f = *objective_;
  auto term = f.token_loss(*this, logp, start);
  if (!f.has_row_term()) return term;
  // The row term in fp64 whatever the log-probs' dtype, from their sum on: a row's sum of T log-probs reaches
  // |S| ~ 10^3, where fp32's spacing is 1e-4, and DPO's log-ratio S - ref cancels most of it. In fp32 that left DPO's
  // coefficient beta (1 - sigmoid(beta l)) with a relative error of 2e-5 on every tensor (issue #28: 10-50x standard's
  // whole fp32 error, and 1.5x in bf16), different for each summation order.
  const auto s_chunk = f.row_statistics(*this, logp.to(at::kDouble), start);  // [B] fp64
  if (start == 0 && logp.size(1) == seq_len_)  // the whole sequence at once
    return term + f.row_loss(*this, s_chunk).to(term.scalar_type());
  if (!statistics_.defined())
    throw std::logic_error(f.name() + ": a head chunk that is not the whole sequence needs the statistics pass first");
  auto row = f.row_loss(*this, f.statistics_rest(statistics_, s_chunk) + s_chunk);
  // R's value is counted once, in the first chunk; later chunks add only their share of its gradient.
  if (start > 0) row = row - f.row_loss(*this, statistics_);
  return term + row.to(term.scalar_type());
}

at::Tensor Objective::statistics_rest(const at::Tensor& total, const at::Tensor& s_chunk) const {
  return total - s_chunk.detach();
}

StatisticsPass::StatisticsPass(const PreparedObjective& objective)
    : objective_(objective),
      sums_(at::zeros({objective.sequences_}, objective.targets_.options().dtype(at::kDouble))) {}

void StatisticsPass::add(at::Tensor& logits, std::int64_t start) {
  at::NoGradGuard no_grad;
  const auto logp = objective_.logps_in_place(logits, start).to(at::kDouble);  // fp64, as chunk_term
  sums_ += objective_.objective().row_statistics(objective_, logp, start);
}

PreparedObjective StatisticsPass::finish(const std::function<void(at::Tensor&)>& group_sum) {
  TORCH_CHECK(sums_.defined(), "StatisticsPass::finish called twice");
  if (group_sum) group_sum(sums_);
  PreparedObjective complete = objective_;
  complete.statistics_ = std::move(sums_);
  return complete;
}

at::Tensor PreparedObjective::chunk_loss(const at::Tensor& logits, std::int64_t start) const {
  return chunk_term(logps(logits, start), start);
}

double PreparedObjective::chunk_loss_and_grad(at::Tensor& logits, std::int64_t start) const {
  at::Tensor row_sum;  // [N, 1]: logits now hold exp(logits / temperature - max); softmax = that / row_sum
  const auto logp = logps_in_place(logits, start, &row_sum);
  at::Tensor g;  // dTerm/dlogp: [B, c]
  double value = 0;
  {
    at::AutoGradMode enable_grad(true);
    const auto leaf = logp.detach().requires_grad_(true);
    const auto term = chunk_term(leaf, start);
    value = term.item<double>();
    g = torch::autograd::grad({term}, {leaf}, {}, /*retain_graph=*/false, /*create_graph=*/false,
                              /*allow_unused=*/true)[0];
  }
  at::NoGradGuard no_grad;
  // The chain rule through logps()'s mask: an unscored position's logit gets no gradient.
  g = g.defined() ? g * chunk_of(scored_, start, logp) : at::zeros_like(logp);
  // dTerm/dlogits = (onehot(target) - softmax) * g / temperature, written over the exponentials (one pass: the
  // softmax's division is folded into the row factor).
  const auto V = logits.size(2);
  auto x = logits.view({-1, V});
  const auto coef = (g / temperature_).reshape({-1, 1});
  x.mul_(-(coef / row_sum.to(coef.scalar_type())));
  x.scatter_add_(1, targets_.slice(1, start, start + logits.size(1)).clamp_min(0).reshape({-1, 1}), coef);
  return value;
}

double PreparedObjective::chunk_loss_and_grad_by_autograd(at::Tensor& logits, std::int64_t start) const {
  auto leaf = logits.detach().requires_grad_(true);
  const auto loss = chunk_loss(leaf, start);
  loss.backward();
  logits.copy_(leaf.grad());
  return loss.item<double>();
}

void Objective::add_synthetic_logps(Batch&, const at::Tensor&, std::uint64_t, bool) const {}

Batch Objective::with_reference(const Batch& batch, const at::Tensor&) const { return batch; }

}  // namespace sbp
