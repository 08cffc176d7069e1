#include "core/objectives/grpo.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include "core/io/input_error.h"

namespace sbp {

// What GRPO keeps of a batch besides its targets. "Sequence" is a row, or one sequence of a packed row (cu_seqlens
// order): n of them.
struct GrpoObjective::State final : ObjectiveState {
  at::Tensor advantages;  // [n] fp64
  at::Tensor old, ref;    // [B, T] fp64 per position (t scores token t + 1); old undefined: the current policy
  at::Tensor counts;      // [n] fp64: completion tokens of each sequence (n_s)
  at::Tensor weights;     // [n] fp64: the loss_type's normaliser per token of sequence s
  at::Tensor row;         // [n] int64: the row holding sequence s
  at::Tensor sequence_of; // [B, T] int64: each position's sequence; undefined for unpacked rows (the row itself)
  // [B, c]: the old policy's log-probs of a chunk (the current one's, detached, without old_logps).
  at::Tensor old_chunk(const at::Tensor& logp, std::int64_t start) const {
    return old.defined() ? chunk_of(old, start, logp) : logp.detach();
  }
};

namespace {

// [B, T] int64: the index (cu_seqlens order) of the sequence each position of packed rows belongs to.
at::Tensor sequence_index(const PackedRows& rows) {
  auto out = at::empty({rows.rows(), rows.seq_len()}, at::TensorOptions().dtype(at::kLong));
  auto a = out.accessor<std::int64_t, 2>();
  std::int64_t index = 0;
  for (std::int64_t r = 0; r < rows.rows(); ++r)
    for (const auto s : rows.starts(r)) {
      for (std::int64_t p = s, e = rows.sequence_end(r, s); p < e; ++p) a[r][p] = index;
      ++index;
    }
  return out;
}

// Sums of `per_position` [B, c] over each sequence: [n], by `index` [B, c] (the positions' sequences).
at::Tensor sum_per_sequence(const at::Tensor& per_position, const at::Tensor& index, std::int64_t n) {
  return at::zeros({n}, per_position.options()).index_add_(0, index.reshape({-1}), per_position.reshape({-1}));
}

// Group-normalised N(0, 1) rewards of `count` completions in groups of `group` consecutive ones: (r - mean) /
// (std + 1e-4), TRL's scale_rewards=group. Packed rows' random lengths rarely give a multiple of the group: the last
// group then takes the remainder, or joins the one before when the remainder is a single completion (a group of one
// has no spread); a batch of one packed sequence keeps its raw reward.
at::Tensor group_advantages(std::int64_t count, std::int64_t group, std::uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const auto normalised = [](const at::Tensor& r) {  // [groups, size]
    const auto mean = r.mean(1, /*keepdim=*/true), std = r.std(1, /*unbiased=*/true, /*keepdim=*/true);
    return (r - mean) / (std + 1e-4);
  };
  if (count % group == 0) return normalised(at::normal(0.0, 1.0, {count / group, group}, gen, f64)).reshape({count});
  const auto rewards = at::normal(0.0, 1.0, {count}, gen, f64);
  if (count == 1) return rewards;  // one packed sequence in all (maxlen's small T): nothing to normalise within
  auto full = count / group, rest = count % group;
  if (rest == 1 && full > 0) --full, rest += group;  // the single last completion joins the group before it
  std::vector<at::Tensor> parts;
  if (full > 0) parts.push_back(normalised(rewards.slice(0, 0, full * group).view({full, group})).reshape({-1}));
  parts.push_back(normalised(rewards.slice(0, full * group).unsqueeze(0)).reshape({-1}));
  return at::cat(parts);
}

void check_group(std::int64_t group, std::int64_t count, const char* what, bool ragged) {
  if (group < 2)
    throw InputError("grpo: --group must be >= 2 (advantages are normalised within a group; a group of one "
                     "has advantage 0), got " + std::to_string(group));
  if (!ragged && count % group != 0)
    throw InputError(fmt::format("grpo: {} {} is not a multiple of --group {}", what, count, group));
}

}  // namespace

GrpoObjective::GrpoObjective(const Spec& spec) {
  spec.check_keys({"beta", "epsilon_low", "epsilon_high", "loss_type", "temperature", "importance", "max_completion_length",
                   "kl"});
  Options o;
  o.beta = spec.get_double("beta", o.beta, 0.0, 1e6);
  o.epsilon_low = spec.get_double("epsilon_low", o.epsilon_low, 0.0, 1.0);
  o.epsilon_high = spec.get_double("epsilon_high", o.epsilon_high, 0.0, 1e6);
  o.temperature = spec.get_double("temperature", o.temperature, 1e-6, 1e6);
  o.loss_type = spec.get_choice("loss_type", o.loss_type, {"grpo", "bnpo", "dr_grpo", "dapo"});
  o.importance = spec.get_choice("importance", o.importance, {"token", "sequence"});
  o.max_completion_length = spec.get_int("max_completion_length", o.max_completion_length, 1);
  o.kl = spec.get_choice("kl", o.kl, {"k3", "k3_ratio"});
  if (o.kl == "k3_ratio" && o.importance != "token")
    throw InputError("grpo: kl=k3_ratio is defined here for importance=token only (with sequence importance TRL "
                     "broadcasts the row's ratio onto every token's KL, a row term this objective does not have yet)");
  options_ = o;
}

std::string GrpoObjective::spec() const {
  const auto& o = options_;
  return fmt::format("grpo:beta={},epsilon_low={},epsilon_high={},loss_type={},temperature={},importance={},"
                     "max_completion_length={}",
                     o.beta, o.epsilon_low, o.epsilon_high, o.loss_type, o.temperature, o.importance,
                     o.max_completion_length) +
         (o.kl == "k3" ? "" : ",kl=" + o.kl);  // named when not the default, so that older specs stay canonical
}

Batch GrpoObjective::random_batch(const ModelConfig& config, const RandomBatchOptions& o) const {
  if (o.pack.packed()) {
    if (o.batch_size < 1 || o.seq_len < 2) throw InputError("random batch needs B >= 1 and T >= 2");
    if (o.pad_fraction != 0)
      throw InputError("--pad-fraction with --pack: a packed row is filled with sequences, its last one cut to fit");
    return packed_grpo_batch(config, o.pack.draw(o.batch_size, o.seq_len, o.seed), o.group, o.seed, o.prompt_fraction);
  }
  const auto B = o.batch_size, G = o.group > 0 ? o.group : o.batch_size;
  check_group(G, B, "--batch", /*ragged=*/false);
  std::vector<std::int64_t> prompt_of_row(B);
  for (std::int64_t r = 0; r < B; ++r) prompt_of_row[r] = r / G;
  Batch batch = random_completion_batch(config, o, prompt_of_row);
  batch.fields["advantages"] = group_advantages(B, G, o.seed + 1);
  return batch;
}

Batch packed_grpo_batch(const ModelConfig& config, const std::vector<std::vector<std::int64_t>>& lengths,
                        std::int64_t group, std::uint64_t seed, double prompt_fraction) {
  if (prompt_fraction < 0 || prompt_fraction >= 1) throw InputError("prompt fraction must be in [0, 1)");
  std::int64_t T = 0, n = 0;
  for (const auto L : lengths.at(0)) T += L;
  for (const auto& row : lengths) n += std::int64_t(row.size());
  const auto G = group > 0 ? group : std::max<std::int64_t>(n, 2);
  check_group(G, n, "the packed sequences' count", /*ragged=*/true);
  const auto B = std::int64_t(lengths.size());
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Batch b;
  b.input_ids = at::randint(0, config.vocab_size, {B, T}, gen, at::TensorOptions().dtype(at::kLong));
  b.attention_mask = at::ones({B, T}, at::kLong);
  b.packed = PackedRows::from_lengths(lengths, T);  // checks that every row's lengths sum to T
  auto completion = at::zeros({B, T}, at::kLong);
  const auto u = at::rand({n}, gen, at::TensorOptions().dtype(at::kDouble));
  std::int64_t i = 0;
  for (std::int64_t r = 0; r < B; ++r) {
    std::int64_t start = 0;
    for (const auto L : lengths[std::size_t(r)]) {
      const auto share = prompt_fraction > 0 ? prompt_fraction : u[i].item<double>() / 2;
      ++i;
      const auto prompt = std::clamp<std::int64_t>(std::llround(share * double(L)), 1, L);
      completion[r].slice(0, start + prompt, start + L).fill_(1);
      start += L;
    }
  }
  if (!completion.any().item<bool>())
    throw InputError("grpo: packed sequences of one token only have no completion to score");
  b.fields["completion_mask"] = completion;
  b.fields["advantages"] = group_advantages(n, G, seed + 1);
  return b;
}

void GrpoObjective::add_synthetic_logps(Batch& batch, const at::Tensor& token_logps, std::uint64_t seed,
                                        bool reference_given) const {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed + 2);
  const auto completion = batch.field("completion_mask").to(at::kDouble);
  const auto policy = token_logps.to(at::kDouble);
  // Drawn on the CPU (one seed gives the same batch on every device), then moved.
  const auto noise = [&] { return at::normal(0.0, 0.3, policy.sizes(), gen, at::kDouble).to(policy.device()); };
  // The log-ratio logp - old_logp of every token (token importance) or its row mean (sequence importance) is kept
  // kClipMargin away from the clip edges log(1 - epsilon_low) and log(1 + epsilon_high). At an edge the clipped term
  // switches branch and the token's gradient jumps; a bf16 run's log-probs differ from the fp64 oracle's by ~1e-2, so
  // a token within that distance of an edge can be clipped in one run and not in the other: a gradient error that is
  // no rounding noise, which decided low-precision verdicts at random (issue #28: 4.9x standard-bf16's error on a
  // LoRA weight for one seed and one chunking, 1.0x for the next). Both branches stay well populated.
  constexpr double kClipMargin = 0.1;
  auto log_ratio = -noise();  // [B, T]
  const auto away_from_edges = [&](at::Tensor d) {
    for (const double edge : {std::log1p(options_.epsilon_high), std::log1p(-options_.epsilon_low)}) {
      if (!std::isfinite(edge)) continue;
      const auto offset = d - edge;
      d = at::where(offset.abs() < kClipMargin, edge + at::where(offset >= 0, kClipMargin, -kClipMargin), d);
    }
    return d;
  };
  if (options_.importance == "token") {
    log_ratio = away_from_edges(log_ratio);
  } else if (!batch.packed) {  // shift each row so that its mean over the completion moves out of the edges' reach
    const auto mean = (log_ratio * completion).sum(1) / completion.sum(1).clamp_min(1.0);  // [B]
    log_ratio = log_ratio + (away_from_edges(mean) - mean).unsqueeze(1);
  } else {  // the same per packed sequence: its ratio is its own mean
    const auto index = sequence_index(*batch.packed).to(policy.device());
    const auto n = batch.packed->sequences();
    const auto mean = sum_per_sequence(log_ratio * completion, index, n) /
                      sum_per_sequence(completion, index, n).clamp_min(1.0);  // [n]
    log_ratio = log_ratio + (away_from_edges(mean) - mean).index_select(0, index.reshape({-1})).view_as(log_ratio);
  }
  batch.fields["old_logps"] = (policy - log_ratio) * completion;
  if (options_.beta > 0 && !reference_given) batch.fields["ref_logps"] = (policy + noise()) * completion;
}

Batch GrpoObjective::with_reference(const Batch& batch, const at::Tensor& token_logps) const {
  Batch out = batch;
  out.fields["ref_logps"] = token_logps.to(at::kDouble) * batch.field("completion_mask").to(at::kDouble);
  return out;
}

Objective::Fields GrpoObjective::prepare_fields(const Batch& b, const ModelConfig&,
                                                const std::optional<StepTotals>& step_totals,
                                                const std::string& source) const {
  check_field_names(b, {"completion_mask", "advantages"}, {"old_logps", "ref_logps"}, "grpo", source);
  const auto B = b.batch_size(), T = b.seq_len();
  const auto completion = checked_completion_mask(b, source);  // [B, T] per token
  auto state = std::make_shared<State>();
  const auto n = b.packed ? b.packed->sequences() : B;  // sequences
  if (b.packed) {
    // verl's remove-padding layout: each packed sequence is one prompt + completion. Its first token is prompt (no
    // position of its own sequence predicts it; the one before belongs to the previous sequence).
    const auto on_cpu = completion.to(at::kCPU).contiguous();
    const auto first = on_cpu.accessor<std::int64_t, 2>();
    for (std::int64_t r = 0; r < B; ++r)
      for (const auto s : b.packed->starts(r))
        if (first[r][s] != 0)
          throw InputError(fmt::format("{}: row {}, position {}: completion_mask is 1 on a packed sequence's first "
                                       "token, which nothing in its sequence predicts (each packed sequence is one "
                                       "completion: prompt tokens first, completion_mask 0 on them)", source, r, s));
    const auto& a = b.field("advantages");
    if (a.dim() != 1 || a.size(0) != n)
      throw InputError(fmt::format("{}: advantages has shape {}: a packed batch gives one advantage per packed "
                                   "sequence, in the order of cu_seqlens ([{}] here; {} rows)", source,
                                   c10::str(a.sizes()), n, B));
    state->sequence_of = sequence_index(*b.packed).to(b.input_ids.device());
    std::vector<std::int64_t> rows;
    for (std::int64_t r = 0; r < B; ++r) rows.insert(rows.end(), b.packed->starts(r).size(), r);
    state->row = at::tensor(rows, at::TensorOptions().dtype(at::kLong)).to(b.input_ids.device());
  } else {
    state->row = at::arange(B, b.input_ids.options().dtype(at::kLong));
  }
  state->advantages = checked_float_field(b, "advantages", {n}, {}, source);
  if (b.has("old_logps")) state->old = shift_left(checked_float_field(b, "old_logps", {B, T}, completion, source), 0.0);
  if (options_.beta > 0) {
    if (!b.has("ref_logps"))
      throw InputError(source + ": grpo with beta > 0 needs ref_logps in the batch or --ref (a reference model)");
    state->ref = shift_left(checked_float_field(b, "ref_logps", {B, T}, completion, source), 0.0);
  }
  const auto scored = shift_left(completion, 0);  // position t is scored when token t + 1 is a completion token
  Fields fields;
  fields.targets = at::where(scored == 1, shift_left(b.input_ids, 0), -1);
  check_targets_within_sequences(b, fields.targets, "completion_mask", source);  // the check above says why first
  // A completion token and the position scoring it lie in one sequence (checked above), so either's index counts it.
  state->counts = b.packed ? sum_per_sequence(completion.to(at::kDouble), state->sequence_of, n)
                           : completion.sum(1).to(at::kDouble);
  const auto& counts = state->counts;
  if (options_.loss_type == "dr_grpo") {
    const auto longest = counts.max().item<double>();
    if (longest > double(options_.max_completion_length))
      throw InputError(source + ": a completion has " + std::to_string(std::int64_t(longest)) +
                                  " tokens, more than max_completion_length=" +
                                  std::to_string(options_.max_completion_length) + " (dr_grpo's normaliser)");
  }
  // grpo and dr_grpo count completions (TRL's per_token_loss.size(0)): rows, or packed sequences; bnpo and dapo
  // count completion tokens, whatever the layout.
  if (options_.loss_type == "grpo")
    state->weights = 1.0 / (rows_normaliser(step_totals, n) * counts.clamp_min(1.0));
  else if (options_.loss_type == "dr_grpo")
    state->weights = at::full({n}, 1.0 / (rows_normaliser(step_totals, n) * double(options_.max_completion_length)),
                              counts.options());
  else  // bnpo, dapo
    state->weights = at::full({n}, 1.0 / std::max(1.0, tokens_normaliser(step_totals, counts.sum().item<double>())),
                              counts.options());
  fields.state_bytes_per_token = (state->old.defined() ? 8 : 0) + (state->ref.defined() ? 8 : 0) +  // fp64 each
                                 (state->sequence_of.defined() ? 8 : 0);                            // int64
  // Sequence importance couples a sequence's tokens through sum(logp - old); without old_logps that sum is 0 in
  // value, known before any chunk: no statistics pass.
  fields.statistics_known = !state->old.defined();
  fields.state = std::move(state);
  return fields;
}

at::Tensor GrpoObjective::clipped_surrogate(const at::Tensor& w, const at::Tensor& advantages) const {
  // TRL's form, ties included: where both terms are equal at::minimum splits the gradient between them.
  return -at::minimum(w * advantages, at::clamp(w, 1.0 - options_.epsilon_low, 1.0 + options_.epsilon_high) * advantages);
}

const at::Tensor& GrpoObjective::sequence_counts(const PreparedObjective& p) const { return p.state<State>().counts; }
const at::Tensor& GrpoObjective::row_of_sequence(const PreparedObjective& p) const { return p.state<State>().row; }
const at::Tensor& GrpoObjective::sequence_of_position(const PreparedObjective& p) const {
  return p.state<State>().sequence_of;
}

at::Tensor GrpoObjective::sequence_advantages(const PreparedObjective& p) const { return p.state<State>().advantages; }
at::Tensor GrpoObjective::sequence_weights(const PreparedObjective& p) const { return p.state<State>().weights; }

at::Tensor GrpoObjective::per_position(const PreparedObjective& prepared, const at::Tensor& values, std::int64_t start,
                                       const at::Tensor& like) const {
  const auto& index = sequence_of_position(prepared);
  const auto v = values.to(like.scalar_type());
  if (!index.defined()) return v.unsqueeze(1);  // a row is its sequence
  const auto chunk = index.slice(1, start, start + like.size(1));
  return v.index_select(0, chunk.reshape({-1})).view(chunk.sizes());
}

at::Tensor GrpoObjective::token_weights(const PreparedObjective& prepared, const at::Tensor& mask,
                                        std::int64_t start) const {
  return per_position(prepared, sequence_weights(prepared), start, mask);
}

at::Tensor GrpoObjective::token_loss(const PreparedObjective& prepared, const at::Tensor& logp,
                                     std::int64_t start) const {
  const auto& state = prepared.state<State>();
  const auto mask = chunk_of(prepared.scored(), start, logp);  // [B, c]
  const auto weights = token_weights(prepared, mask, start);   // [B, c] or [B, 1]
  auto per_token = at::zeros_like(logp);
  at::Tensor w;
  if (options_.importance == "token") {
    w = at::exp(logp - state.old_chunk(logp, start));
    per_token = clipped_surrogate(w, per_position(prepared, sequence_advantages(prepared), start, logp));
  }
  if (options_.beta > 0) {
    const auto delta = chunk_of(state.ref, start, logp) - logp;
    auto kl = at::exp(delta) - delta - 1.0;
    if (options_.kl == "k3_ratio") kl = kl * w;  // TRL's bias correction: the ratio's gradient included
    per_token = per_token + options_.beta * kl;
  }
  return (per_token * mask * weights).sum();
}

at::Tensor GrpoObjective::row_statistics(const PreparedObjective& prepared, const at::Tensor& logp,
                                         std::int64_t start) const {
  const auto& state = prepared.state<State>();
  const auto log_ratio = (logp - state.old_chunk(logp, start)) * chunk_of(prepared.scored(), start, logp);  // [B, c]
  if (!state.sequence_of.defined()) return log_ratio.sum(1);  // [B]
  return sum_per_sequence(log_ratio, state.sequence_of.slice(1, start, start + logp.size(1)),
                          state.counts.size(0));  // [n]
}

at::Tensor GrpoObjective::row_loss(const PreparedObjective& prepared, const at::Tensor& S) const {
  const auto& state = prepared.state<State>();
  const auto dtype = S.scalar_type();
  const auto w = at::exp(S / state.counts.clamp_min(1.0).to(dtype));  // [n]: TRL's sequence-level ratio
  // Every completion token of sequence s carries the same surrogate: weight x count of them.
  return (clipped_surrogate(w, sequence_advantages(prepared).to(dtype)) *
          (sequence_weights(prepared) * state.counts).to(dtype))
      .sum();
}

}  // namespace sbp
