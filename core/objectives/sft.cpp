#include "core/objectives/sft.h"

#include <stdexcept>

#include <ATen/ATen.h>

#include "core/io/input_error.h"
#include "core/objectives/packed_batch.h"

namespace sbp {

// What SFT keeps of a batch besides its targets.
struct SftObjective::State final : ObjectiveState {
  double normaliser = 0;  // the valid shifted labels of the batch, or the step's scored tokens
};

SftObjective::SftObjective(const Spec& spec) { spec.check_keys({}); }

Batch SftObjective::random_batch(const ModelConfig& config, const RandomBatchOptions& options) const {
  return options.pack.packed() ? random_packed_sft_batch(config, options) : random_sft_batch(config, options);
}

Objective::Fields SftObjective::prepare_fields(const Batch& b, const ModelConfig& config,
                                               const std::optional<StepTotals>& step_totals,
                                               const std::string& source) const {
  check_field_names(b, {"labels"}, {}, "sft", source);
  const auto& labels = b.field("labels");  // [B, T]
  auto fail = [&](const std::string& what) { throw InputError(source + ": " + what); };
  if (labels.sizes() != b.input_ids.sizes())
    fail("labels " + c10::str(labels.sizes()) + " must have the shape of input_ids " + c10::str(b.input_ids.sizes()));
  if (labels.scalar_type() != at::kLong) fail("labels must be int64, got " + std::string(c10::toString(labels.scalar_type())));
  if (!((b.attention_mask == 1) | (labels == -100)).all().item<bool>()) fail("labels on padded positions must be -100");
  const auto valid_labels = labels.masked_select(labels != -100);
  if (!((valid_labels >= 0) & (valid_labels < config.vocab_size)).all().item<bool>())
    fail("labels must be -100 or in [0, vocab_size=" + std::to_string(config.vocab_size) + ")");
  const auto shifted = shift_left(labels, -100);  // position t is scored on labels[t + 1]
  Fields fields;
  fields.targets = shifted.masked_fill(shifted == -100, -1);
  check_targets_within_sequences(b, fields.targets, "labels", source);
  const auto num_valid = (fields.targets >= 0).sum().item<std::int64_t>();
  if (num_valid == 0) fail("sft: the batch has no valid shifted label (all -100): the loss would be 0/0");
  auto state = std::make_shared<State>();
  state->normaliser = tokens_normaliser(step_totals, double(num_valid));
  fields.state = std::move(state);
  return fields;
}

at::Tensor SftObjective::token_loss(const PreparedObjective& prepared, const at::Tensor& logp, std::int64_t) const {
  return -logp.sum() / prepared.state<State>().normaliser;
}

}  // namespace sbp
