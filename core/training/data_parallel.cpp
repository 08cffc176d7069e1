#include "core/training/data_parallel.h"

#include <ATen/ATen.h>

namespace sbp {

StepTotals DataParallel::global_totals(const StepTotals& local) {
  std::vector<at::Tensor> t = {at::tensor(std::vector<std::int64_t>{local.rows, local.tokens}, at::kLong)};
  communicator_.all_reduce_sum(t);
  return {t[0][0].item<std::int64_t>(), t[0][1].item<std::int64_t>()};
}

void DataParallel::reduce(const GradientGroup& group) {
  std::vector<at::Tensor> grads;
  for (const auto& p : group.tensors) {
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    grads.push_back(p.grad());
  }
  if (grads.empty()) return;
  // One collective per group: the gradients flattened into one buffer (a group's tensors share one dtype).
  std::vector<at::Tensor> views;
  for (const auto& g : grads) views.push_back(g.reshape({-1}));
  std::vector<at::Tensor> flat = {at::cat(views)};
  communicator_.all_reduce_sum(flat);
  std::int64_t offset = 0;
  for (auto& g : grads) {
    g.copy_(flat[0].slice(0, offset, offset + g.numel()).view(g.sizes()));
    offset += g.numel();
  }
}

double DataParallel::global_loss(double local) {
  std::vector<at::Tensor> t = {at::tensor(std::vector<double>{local}, at::kDouble)};
  communicator_.all_reduce_sum(t);
  return t[0].item<double>();
}

}  // namespace sbp
