#include "core/objective.h"

#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

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

double Objective::chunk_loss_and_grad(at::Tensor& logits, std::int64_t start) const {
  auto leaf = logits.detach().requires_grad_(true);
  const auto loss = chunk_loss(leaf, start);
  loss.backward();
  logits.copy_(leaf.grad());
  return loss.item<double>();
}

double SftObjective::chunk_loss_and_grad(at::Tensor& logits, std::int64_t start) const {
  at::NoGradGuard no_grad;
  const auto V = logits.size(2);
  auto x = logits.view({-1, V});  // [N, V], N = B*c
  const auto targets = shifted_labels_.slice(1, start, start + logits.size(1)).reshape({-1, 1});  // [N, 1]
  const auto valid = (targets != -100).to(x.scalar_type());                                         // [N, 1]
  const auto safe_targets = targets.clamp_min(0);
  const auto picked = x.gather(1, safe_targets);  // target logits, before x is overwritten
  // log-sum-exp and softmax in place: x <- exp(x - max) / sum.
  const auto row_max = std::get<0>(x.max(1, /*keepdim=*/true));
  x.sub_(row_max).exp_();
  const auto row_sum = x.sum(1, /*keepdim=*/true);
  x.div_(row_sum);
  const auto nll = row_max + row_sum.log() - picked;  // [N, 1]
  const double loss = (nll * valid).sum().item<double>() / double(num_valid_);
  x.scatter_add_(1, safe_targets, -valid);  // softmax - onehot on valid rows
  x.mul_(valid / double(num_valid_));      // ignored rows contribute nothing
  return loss;
}

std::unique_ptr<Objective> make_objective(const std::string& name) {
  if (name == "sft") return std::make_unique<SftObjective>();
  throw std::invalid_argument("unknown objective '" + name + "' (known: sft)");
}

}  // namespace sbp
