#include "core/methods/layer_checkpoints.h"

#include <stdexcept>
#include <string>
#include <utility>

#include "core/offload/offload_tier.h"

namespace sbp {

LayerCheckpoints::LayerCheckpoints(int slots, OffloadTier* tier) : device_(slots), host_(slots), tier_(tier) {}

void LayerCheckpoints::set(int i, at::Tensor h) {
  device_of_slots_ = h.device();
  device_.at(i) = std::move(h);
}

const at::Tensor& LayerCheckpoints::get(int i) const {
  const auto& h = device_.at(i);
  if (!h.defined()) throw std::logic_error("LayerCheckpoints: slot " + std::to_string(i) + " is not on the device");
  return h;
}

void LayerCheckpoints::done_reading(int i) {
  if (!tier_) return;
  host_.at(i) = tier_->store(get(i));
  device_[i].reset();
}

at::Tensor LayerCheckpoints::take(int i) {
  auto& slot = device_.at(i);
  if (!slot.defined()) {
    if (!host_.at(i).defined()) throw std::logic_error("LayerCheckpoints: slot " + std::to_string(i) + " is empty");
    slot = tier_->fetch(host_[i], device_of_slots_);
  }
  if (tier_) {
    tier_->ready(slot);
    host_[i].reset();
    // The next slot the backward takes, fetched now: it arrives while this one is worked on (a side stream on CUDA).
    if (i > 0 && host_[i - 1].defined() && !device_[i - 1].defined())
      device_[i - 1] = tier_->fetch(host_[i - 1], device_of_slots_);
  }
  return std::exchange(slot, at::Tensor());
}

}  // namespace sbp
