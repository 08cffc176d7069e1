// One process's parameter offload (ARCHITECTURE.md §15): the trainable tensors live in an offload tier, their homes;
// the model's tensors hold values on the device only while a method uses them (the parameter-use events of
// core/methods/method.h: a layer's forward, its backward; the embedding and head for the whole step), fetched at the
// first begin and dropped at the matching last end, as ZeRO-3 gathers and frees its slices (DataParallel::use). The
// optimizer updates the homes where they are. Copies only: a run with it equals the run without it bitwise.
#pragma once

#include <map>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/io/safetensors.h"
#include "core/methods/method.h"

namespace sbp {

class OffloadTier;

class ParameterHome {
 public:
  // Moves every tensor of `trainable` into `tier` (the model's tensors are then empty until used). The tier outlives
  // this object.
  ParameterHome(const TensorList& trainable, OffloadTier& tier);
  // Every tensor whole on the device again, with its home's values (a driver that measures with a fresh trainer per
  // probe starts from the whole model).
  ~ParameterHome();
  ParameterHome(const ParameterHome&) = delete;
  ParameterHome& operator=(const ParameterHome&) = delete;

  // A parameter-use event (BackpropMethod::on_parameter_use).
  void use(const ParameterUse& use);
  // What the optimizer updates: the homes, under the tensors' names.
  const TensorList& optimizer_params() const { return homes_; }
  // Between the BP and the update: each home's gradient is its model tensor's (and back to none after the update).
  void attach_gradients();
  void detach_gradients();
  // Inside a use of every tensor, after values were written into the model's tensors (a loaded checkpoint): the homes
  // take them.
  void keep();
  // A use of every trainable tensor (a pass outside a step, saving the model).
  ParameterUse whole(bool begin) const;

 private:
  struct Entry {
    at::Tensor param, home;
    int users = 0;  // open uses (nested begins)
  };
  std::map<const void*, Entry> entries_;  // by the model tensor's impl
  TensorList homes_;
  OffloadTier& tier_;
  c10::Device device_ = c10::Device(c10::kCPU);  // the model's
};

}  // namespace sbp
