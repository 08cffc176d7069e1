#include "core/objective.h"

#include <stdexcept>

#include <ATen/ATen.h>

namespace sbp {

void SftObjective::prepare(const Batch& batch) {
  const auto& labels = batch.labels;  // [B, T]
  shifted_labels_ = at::cat({labels.slice(1, 1), at::full({labels.size(0), 1}, -100, labels.options())}, 1);
  num_valid_ = (shifted_labels_ != -100).sum().item<std::int64_t>();
  if (num_valid_ == 0)
    throw std::invalid_argument("sft: the batch has no valid shifted label (all -100): the loss would be 0/0");
}

at::Tensor SftObjective::chunk_loss(const at::Tensor& logits, std::int64_t start) const {
  const auto c = logits.size(1);
  const auto targets = shifted_labels_.slice(1, start, start + c).reshape({-1});  // [B*c]
  const auto nll_sum = at::cross_entropy_loss(logits.reshape({-1, logits.size(2)}), targets, {},
                                              at::Reduction::Sum, /*ignore_index=*/-100);
  return nll_sum / double(num_valid_);
}

std::unique_ptr<Objective> make_objective(const std::string& name) {
  if (name == "sft") return std::make_unique<SftObjective>();
  throw std::invalid_argument("unknown objective '" + name + "' (known: sft)");
}

}  // namespace sbp
