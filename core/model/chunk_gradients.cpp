#include "core/model/chunk_gradients.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

namespace sbp {

ChunkGradients::ChunkGradients(std::vector<at::Tensor> params, SumDtype sum_dtype)
    : params_(std::move(params)), sums_(params_.size()), sum_dtype_(std::move(sum_dtype)) {}

c10::ScalarType ChunkGradients::accumulation_dtype(c10::ScalarType dtype) {
  return dtype == at::kBFloat16 || dtype == at::kHalf ? at::kFloat : dtype;
}

void ChunkGradients::add(at::ArrayRef<at::Tensor> grads) {
  TORCH_CHECK(grads.size() == params_.size(), "ChunkGradients: one gradient per parameter");
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) continue;
    if (!sums_[i].defined())
      sums_[i] = grads[i].to(sum_dtype_(grads[i].scalar_type()));
    else
      sums_[i].add_(grads[i]);
  }
}

void ChunkGradients::commit() {
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!sums_[i].defined()) continue;
    auto& grad = params_[i].mutable_grad();
    if (grad.defined())
      grad.add_(sums_[i].to(params_[i].scalar_type()));
    else
      grad = sums_[i].to(params_[i].scalar_type());  // the one rounding of a streamed bf16 gradient
    sums_[i].reset();
  }
}

}  // namespace sbp
