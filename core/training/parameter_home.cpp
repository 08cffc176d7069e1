#include "core/training/parameter_home.h"

#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "core/methods/phase.h"
#include "core/offload/offload_tier.h"

namespace sbp {
namespace {

const void* home_key(const at::Tensor& t) { return t.unsafeGetTensorImpl(); }

// Dropped as ZeRO-3 frees a tensor: empty data, the same tensor object (the model's, autograd's saved reference).
void drop_data(const at::Tensor& p) { p.set_data(at::empty({0}, p.options())); }

}  // namespace

ParameterHome::ParameterHome(const TensorList& trainable, OffloadTier& tier) : tier_(tier) {
  at::NoGradGuard no_grad;
  for (const auto& [name, p] : trainable) {
    device_ = p.device();
    auto home = tier_.store(p.detach());
    homes_.push_back({name, home});
    entries_[home_key(p)] = {p, home, 0};
  }
  // The copies into the tier done before anything reads the homes on the host (CUDA: they run on a side stream).
  synchronize(device_);
  for (const auto& [k, e] : entries_) drop_data(e.param);
}

ParameterHome::~ParameterHome() {
  at::NoGradGuard no_grad;
  for (auto& [k, e] : entries_) {
    e.param.set_data(e.home.to(device_, /*non_blocking=*/false, /*copy=*/true));
  }
}

void ParameterHome::use(const ParameterUse& use) {
  at::NoGradGuard no_grad;
  for (const auto& p : use.tensors) {
    const auto it = entries_.find(home_key(p));
    if (it == entries_.end()) throw std::logic_error("parameter offload: '" + use.name + "' uses a tensor it does not hold");
    auto& e = it->second;
    if (use.begin) {
      if (e.users++ > 0) continue;
      auto fetched = tier_.fetch(e.home, device_);
      tier_.ready(fetched);
      e.param.set_data(fetched);
    } else {
      if (e.users == 0) throw std::logic_error("parameter offload: '" + use.name + "' ends a use that did not begin");
      if (--e.users == 0) drop_data(e.param);
    }
  }
}

void ParameterHome::attach_gradients() {
  for (auto& [k, e] : entries_)
    if (e.param.grad().defined()) e.home.mutable_grad() = e.param.grad();
}

void ParameterHome::detach_gradients() {
  for (auto& [k, e] : entries_) e.home.mutable_grad().reset();
}

void ParameterHome::keep() {
  at::NoGradGuard no_grad;
  for (auto& [k, e] : entries_) {
    if (e.users == 0) throw std::logic_error("parameter offload: keep() outside a use of every tensor");
    e.home.copy_(e.param.detach());
  }
}

ParameterUse ParameterHome::whole(bool begin) const {
  ParameterUse use{"model", {}, begin};
  for (const auto& [k, e] : entries_) use.tensors.push_back(e.param);
  return use;
}

}  // namespace sbp
