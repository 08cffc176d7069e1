// The optimizer of a training step (ARCHITECTURE.md §11): AdamW and SGD over the named trainable tensors, equal to
// torch.optim.AdamW / torch.optim.SGD of torch 2.14.1 on CPU bit for bit (tests/oracle/optimizer_oracle.py), plus torch's
// clip_grad_norm_. Specs: "adamw:lr=1e-3,beta1=0.9,beta2=0.999,eps=1e-8,weight_decay=0.01,decay_norms_and_biases=0",
// "sgd:lr=0.1,momentum=0.9,weight_decay=0"; every key is optional.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "core/io/safetensors.h"  // TensorList
#include "core/io/input_error.h"

namespace sbp {

class OffloadTier;

enum class OptimizerKind { AdamW, Sgd };
const char* optimizer_kind_name(OptimizerKind kind);  // "adamw", "sgd": the spec's name

struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::AdamW;
  double lr = 1e-5, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0, momentum = 0.0;
  // false: HF Trainer's parameter groups, no weight decay on biases and norm weights (decays_weight).
  bool decay_norms_and_biases = true;
  // Undefined: each parameter's own dtype (torch's behaviour). Otherwise states, gradient and update in this dtype
  // and the parameter rounded back to its own (see Optimizer::step).
  c10::ScalarType state_dtype = c10::ScalarType::Undefined;
};

// Throws InputError naming the spec and the unknown kind, unknown key or bad value.
OptimizerOptions parse_optimizer_spec(const std::string& spec);
// Canonical spec with every key of the kind, numbers in their shortest exact form: parse_optimizer_spec of it gives
// back `options` exactly. state_dtype is not part of it (a flag of its own, --optimizer-state-dtype).
std::string optimizer_spec(const OptimizerOptions& options);
// "fp64", "fp32" or "bf16" (--optimizer-state-dtype); Throws InputError naming the value otherwise.
c10::ScalarType parse_state_dtype(const std::string& name);
// What a command's --optimizer SPEC and --optimizer-state-dtype D ask for: nothing when both are empty (forward +
// backward only); Throws InputError when only D is given, or either is malformed.
std::optional<OptimizerOptions> parse_optimizer_flags(const std::string& spec, const std::string& state_dtype);

// Whether the tensor `name` (HF/PEFT name) gets the weight decay of `options`. With decay_norms_and_biases=false,
// HF Trainer's get_decay_parameter_names patterns (transformers 5.23) on the lower-cased name exclude it: "bias"
// anywhere, "layernorm", "rmsnorm", "norm" as a whole dotted component, "_norm" ending a component.
bool decays_weight(const OptimizerOptions& options, const std::string& name);

class Optimizer {
 public:
  // `params`: the trainable tensors (leaves; their grad() is read) under their HF/PEFT names, distinct. States are
  // allocated here (zeros), not at the first step as torch does: the same values, and a step never allocates
  // more than its temporaries. Throws InputError on bad options, duplicate names or non-float tensors.
  // With `states_tier`, the states live in that offload tier (ZeRO-Offload) and every update runs where they are: on
  // the CPU the same memory kind, so the same bits; from a GPU, on host copies of the gradient and parameter, the
  // parameter copied back.
  Optimizer(TensorList params, OptimizerOptions options, OffloadTier* states_tier = nullptr);

  // One update at learning rate `lr` of every parameter whose grad() is defined; the others are skipped and keep
  // their own step count, as torch's per-parameter "step" does. Each update is torch's, op for op:
  //   AdamW (torch/optim/adam.py _single_tensor_adam, decoupled weight decay):
  //     p *= 1 - lr*wd;  m.lerp_(g, 1-beta1);  v = v*beta2 + (1-beta2)*g*g;
  //     p.addcdiv_(m, sqrt(v)/sqrt(1-beta2^t) + eps, -lr/(1-beta1^t))   (scalars in double, as Python computes)
  //   SGD (sgd.py _single_tensor_sgd, dampening 0, no nesterov): g += wd*p (coupled); b = g at a tensor's first
  //     update, else b = momentum*b + g; p -= lr*b.
  // With a state_dtype other than a parameter's dtype, its gradient and a copy of the parameter are converted to
  // the state dtype, the whole update above runs there, and the parameter is rounded back once at the end. torch has
  // no such mode, so nothing checks it against an oracle; it equals the update above on fp32 copies.
  void step(double lr);

  std::int64_t steps_taken() const { return steps_taken_; }
  const OptimizerOptions& options() const { return options_; }

  // Resumable state: "step" (int64, 0-dim: steps_taken), and per parameter "<name>.step" (int64, 0-dim: the updates
  // it received) and its tensors: "<name>.exp_avg", "<name>.exp_avg_sq" (AdamW), "<name>.momentum_buffer" (SGD
  // with momentum), in the state dtype. The tensors are the live ones, not copies.
  TensorList state() const;
  // Validates everything first (every name present once, nothing unknown, shapes, dtypes, steps >= 0 and no
  // parameter ahead of "step") and Throws InputError naming `source` and the tensor; then copies the
  // values in. Stepping after a load equals never having stopped, bit for bit.
  void load_state(const TensorList& state, const std::string& source);

  std::int64_t state_bytes() const;  // bytes of the state tensors, counted from the tensors
  // Of those, the bytes on the parameters' device (none when the states are in an offload tier).
  std::int64_t device_state_bytes() const { return states_in_tier_ ? 0 : state_bytes(); }

 private:
  struct Slot {
    std::string name;
    at::Tensor param;
    double weight_decay = 0;
    at::Tensor exp_avg, exp_avg_sq, momentum_buffer;  // undefined where the kind has none
    std::int64_t steps = 0;
  };
  void adamw_update(Slot& slot, const at::Tensor& grad, double lr);
  void sgd_update(Slot& slot, const at::Tensor& grad, double lr);

  OptimizerOptions options_;
  std::vector<Slot> slots_;
  std::int64_t steps_taken_ = 0;
  bool states_in_tier_ = false;
};

// state() into a safetensors file (atomically; metadata: the optimizer spec and state dtype) and back.
void save_optimizer_state(const Optimizer& optimizer, const std::filesystem::path& file);
// The same file from a state assembled elsewhere (ZeRO: the ranks' slices gathered into whole tensors).
void save_optimizer_state(const OptimizerOptions& options, const TensorList& state, const std::filesystem::path& file);
void load_optimizer_state(Optimizer& optimizer, const std::filesystem::path& file);

struct ParamShape {
  std::string name;  // for the weight-decay rule (decays_weight)
  std::vector<std::int64_t> shape;
  c10::ScalarType dtype = c10::ScalarType::Float;  // of the parameter and of its gradient
};
struct OptimizerMemory {
  std::int64_t state_bytes = 0;
  // Extra bytes live at the worst moment of step(), on top of parameters, gradients and states (the CPU meter's
  // peak during step() minus the bytes live before it, tests/unit/test_optimizer.cpp).
  std::int64_t step_temporary_bytes = 0;
};
// Arithmetic, from names, shapes and dtypes only: what Optimizer(params, options) holds and what its step()
// allocates at most (SGD's worst update is a tensor's second or later: its first allocates less).
OptimizerMemory optimizer_memory(const OptimizerOptions& options, const std::vector<ParamShape>& params);

// torch.nn.utils.clip_grad_norm_(params, max_norm) (norm_type 2, foreach=None; torch 2.14.1 on CPU): the 2-norm of
// all defined grad()s, each gradient multiplied by min(max_norm / (norm + 1e-6), 1) in place (also when that is 1).
// Returns the norm before clipping. The norm is computed in the gradients' dtype (bf16 for bf16 gradients), as
// torch does.
double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm);

}  // namespace sbp
