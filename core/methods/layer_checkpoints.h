// The layer inputs a checkpointing method keeps from its forward for its backward (StreamBP, checkpointing, MsT):
// H[l], [B, T, d], for l in [0, L], H[L] being the last hidden state. On the device; or, with an offload tier,
// in host memory: a slot moves out as soon as the forward has read it for the last time (while computing layer l,
// only H[l] and H[l+1] are on the device), and comes back one layer ahead of its use in the backward (while layer l
// is back-propagated, H[l] and the prefetched H[l-1] are). Moves are copies: the values are the same bits.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace sbp {

class OffloadTier;

class LayerCheckpoints {
 public:
  // `slots` = L + 1; `tier` null: everything stays on the device.
  LayerCheckpoints(int slots, OffloadTier* tier);
  // Forward: slot i holds `h` (on the device).
  void set(int i, at::Tensor h);
  // The forward's read of slot i (on the device).
  const at::Tensor& get(int i) const;
  // Forward: slot i will not be read again before the backward; with a tier it leaves the device now.
  void done_reading(int i);
  // Backward: slot i on the device, the slot emptied (the caller holds the only reference); with a tier the fetch of
  // slot i - 1 starts here, so that it overlaps the work on slot i.
  at::Tensor take(int i);

 private:
  std::vector<at::Tensor> device_, host_;
  OffloadTier* tier_;
  c10::Device device_of_slots_ = c10::Device(c10::kCPU);  // where set() put them (the model's device)
};

}  // namespace sbp
