#include "core/training/optimizer.h"

#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/grad_mode.h>
#include <ATen/native/ForeachUtils.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <stdexcept>

#include "core/io/dtype.h"
#include "core/io/spec.h"

#include "core/offload/offload_tier.h"
#include "core/io/input_error.h"

namespace sbp {
namespace {

// Bytes a py_float operand of mul_/div_/add_ allocates for the op's duration: the 0-dim double tensor, and the copy
// in the op's dtype that TensorIterator casts it to unless that is double (measured: fp32 8 + 4, bf16 8 + 2, fp64
// 8). lerp_, addcmul_, addcdiv_ and add_'s alpha pass theirs to the kernel as a Scalar and allocate nothing.
std::int64_t wrapped_scalar_bytes(c10::ScalarType dtype) {
  return 8 + (dtype == c10::kDouble ? 0 : std::int64_t(c10::elementSize(dtype)));
}

// A Python float that torch's Python code passes where an op takes a Tensor (x.mul_(0.9), x / c, x + 1e-6): a
// wrapped-number 0-dim double tensor, the op's second operand. The C++ Scalar overloads are not the same for bf16:
// mul_(Scalar) runs as mul_out(self, scalar, self), the scalar first, and TensorIterator rounds it to bf16
// (x.mul_(0.99) multiplies by 0.98828125), where the Python path multiplies by float(0.99) (the kernels' fast path
// for a scalar second operand). Measured: torch's SGD/AdamW in bf16 with momentum 0.9 or beta2 0.99 differ otherwise.
at::Tensor py_float(double value) { return at::native::wrapped_scalar_tensor(value); }

// Shortest text that parses back to exactly `value` ("1e-05", "0.9").
std::string shortest(double value) {
  char text[64];
  const auto result = std::to_chars(text, text + sizeof text, value);
  return std::string(text, result.ptr);
}

std::string shape_list(at::IntArrayRef shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

c10::ScalarType state_dtype_of(const OptimizerOptions& options, c10::ScalarType param_dtype) {
  return options.state_dtype == c10::ScalarType::Undefined ? param_dtype : options.state_dtype;
}

// `t` itself when it has `dtype` (torch's path: no copy), else a converted copy.
at::Tensor in_dtype(const at::Tensor& t, c10::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

// `t` where the update runs: in `dtype` on `state`'s device (a state in an offload tier on the host while `t` is on a
// GPU: a host copy; the CPU's tier is the CPU: `t` itself).
at::Tensor where_states_are(const at::Tensor& t, c10::ScalarType dtype, const at::Tensor& state) {
  if (!state.defined() || state.device() == t.device()) return in_dtype(t, dtype);
  return t.to(state.device(), dtype, /*non_blocking=*/false, /*copy=*/true);
}

// Elements per slice of AdamW's update after its moments. The update's temporaries (denom; the parameter in the state
// dtype where it is converted) were whole tensors, and the largest, the [V, d] embedding (297 MiB at qwen3-small in
// fp32), was the peak of a training step whose head chunks are small. Every op of that part (sqrt, div_, add_, mul_,
// addcdiv_) is element-wise and computes an element the same way in its vector loop and its scalar tail, so slices
// give torch's bits (tests/oracle/optimizer_oracle.py: its embedding of 77,100 elements spans two slices). 2^16
// elements: two of ATen's grains, so that a slice still runs on two threads.
constexpr std::int64_t kUpdateSlice = std::int64_t(1) << 16;

std::int64_t update_slice_elements(std::int64_t numel) { return std::min(numel, kUpdateSlice); }

// f(param, exp_avg, exp_avg_sq) on matching flat slices of a parameter and its moments; the whole tensors in one call
// where one of them is not contiguous (no flat view).
template <typename F>
void for_each_update_slice(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                           const F& f) {
  if (!param.is_contiguous() || !exp_avg.is_contiguous() || !exp_avg_sq.is_contiguous()) {
    f(param, exp_avg, exp_avg_sq);
    return;
  }
  const auto p = param.view(-1), m = exp_avg.view(-1), v = exp_avg_sq.view(-1);
  const auto n = p.numel();
  for (std::int64_t s = 0; s < n; s += kUpdateSlice) {
    const auto len = std::min(kUpdateSlice, n - s);
    f(p.narrow(0, s, len), m.narrow(0, s, len), v.narrow(0, s, len));
  }
}

void check_options(const OptimizerOptions& o) {
  const auto fail = [&](const std::string& what) {
    throw InputError(std::string("optimizer '") + optimizer_kind_name(o.kind) + "': " + what);
  };
  // torch's own checks (Adam.__init__, SGD.__init__), plus finiteness.
  if (!std::isfinite(o.lr) || o.lr < 0) fail("lr must be a finite number >= 0");
  if (!(o.beta1 >= 0 && o.beta1 < 1) || !(o.beta2 >= 0 && o.beta2 < 1)) fail("beta1 and beta2 must be in [0, 1)");
  if (!std::isfinite(o.eps) || o.eps < 0) fail("eps must be a finite number >= 0");
  if (!std::isfinite(o.weight_decay) || o.weight_decay < 0) fail("weight_decay must be a finite number >= 0");
  if (!std::isfinite(o.momentum) || o.momentum < 0) fail("momentum must be a finite number >= 0");
  if (o.kind == OptimizerKind::AdamW && o.momentum != 0) fail("momentum is an SGD option");
  const auto st = o.state_dtype;
  if (st != c10::ScalarType::Undefined && st != c10::kDouble && st != c10::kFloat && st != c10::kBFloat16)
    fail(std::string("state dtype must be fp64, fp32 or bf16, not ") + c10::toString(st));
}

}  // namespace

const char* optimizer_kind_name(OptimizerKind kind) { return kind == OptimizerKind::AdamW ? "adamw" : "sgd"; }

OptimizerOptions parse_optimizer_spec(const std::string& text) {
  const Spec spec = parse_spec(text, "optimizer");
  OptimizerOptions o;
  constexpr double kBelowOne = 1 - std::numeric_limits<double>::epsilon() / 2;  // beta < 1, as torch requires
  constexpr double kMax = std::numeric_limits<double>::max();
  if (spec.name == "adamw") {
    o.kind = OptimizerKind::AdamW;
    spec.check_keys({"lr", "beta1", "beta2", "eps", "weight_decay", "decay_norms_and_biases"});
    o.beta1 = spec.get_double("beta1", o.beta1, 0, kBelowOne);
    o.beta2 = spec.get_double("beta2", o.beta2, 0, kBelowOne);
    o.eps = spec.get_double("eps", o.eps, 0, kMax);
  } else if (spec.name == "sgd") {
    o.kind = OptimizerKind::Sgd;
    spec.check_keys({"lr", "momentum", "weight_decay", "decay_norms_and_biases"});
    o.momentum = spec.get_double("momentum", o.momentum, 0, kMax);
  } else {
    throw InputError("optimizer spec '" + text + "': unknown optimizer '" + spec.name + "' (adamw, sgd)");
  }
  o.lr = spec.get_double("lr", o.lr, 0, kMax);
  o.weight_decay = spec.get_double("weight_decay", o.weight_decay, 0, kMax);
  o.decay_norms_and_biases = spec.get_choice("decay_norms_and_biases", "1", {"0", "1"}) == "1";
  return o;
}

std::string optimizer_spec(const OptimizerOptions& o) {
  std::string text = optimizer_kind_name(o.kind) + std::string(":lr=") + shortest(o.lr);
  if (o.kind == OptimizerKind::AdamW)
    text += ",beta1=" + shortest(o.beta1) + ",beta2=" + shortest(o.beta2) + ",eps=" + shortest(o.eps);
  else
    text += ",momentum=" + shortest(o.momentum);
  return text + ",weight_decay=" + shortest(o.weight_decay) +
         ",decay_norms_and_biases=" + (o.decay_norms_and_biases ? "1" : "0");
}

c10::ScalarType parse_state_dtype(const std::string& name) {
  if (name == "fp64") return c10::kDouble;
  if (name == "fp32") return c10::kFloat;
  if (name == "bf16") return c10::kBFloat16;
  throw InputError("unknown optimizer state dtype '" + name + "' (fp64, fp32, bf16)");
}

std::optional<OptimizerOptions> parse_optimizer_flags(const std::string& spec, const std::string& state_dtype) {
  if (spec.empty()) {
    if (!state_dtype.empty()) throw InputError("--optimizer-state-dtype needs --optimizer");
    return std::nullopt;
  }
  auto options = parse_optimizer_spec(spec);
  if (!state_dtype.empty()) options.state_dtype = parse_state_dtype(state_dtype);
  return options;
}

bool decays_weight(const OptimizerOptions& options, const std::string& name) {
  if (options.weight_decay == 0) return false;
  if (options.decay_norms_and_biases) return true;
  std::string lower = name;
  for (auto& c : lower) c = char(std::tolower(static_cast<unsigned char>(c)));
  if (lower.find("bias") != std::string::npos || lower.find("layernorm") != std::string::npos ||
      lower.find("rmsnorm") != std::string::npos)
    return false;
  // r"(?:^|\.)norm(?:$|\.)" and r"_norm(?:$|\.)": a dotted component that is "norm" or ends in "_norm".
  for (std::size_t begin = 0; begin <= lower.size();) {
    auto end = lower.find('.', begin);
    if (end == std::string::npos) end = lower.size();
    const auto component = lower.substr(begin, end - begin);
    if (component == "norm" || (component.size() >= 5 && component.ends_with("_norm"))) return false;
    begin = end + 1;
  }
  return true;
}

Optimizer::Optimizer(TensorList params, OptimizerOptions options, OffloadTier* states_tier)
    : options_(std::move(options)), states_in_tier_(states_tier != nullptr) {
  check_options(options_);
  std::set<std::string> names;
  for (auto& [name, param] : params) {
    if (!names.insert(name).second) throw InputError("optimizer: parameter '" + name + "' given twice");
    if (name == "step")
      throw InputError("optimizer: 'step' is reserved for the step count, not a parameter name");
    if (!param.defined() || !at::isFloatingType(param.scalar_type()))
      throw InputError("optimizer: parameter '" + name + "' is not a floating-point tensor");
    Slot slot;
    slot.name = name;
    slot.param = param;
    slot.weight_decay = decays_weight(options_, name) ? options_.weight_decay : 0.0;
    const auto state_dtype = state_dtype_of(options_, param.scalar_type());
    const at::Tensor& tensor = param;  // clang before 16 cannot capture a structured binding (the sanitized build)
    const auto zeros = [&] {
      return states_tier ? states_tier->zeros(tensor.sizes(), state_dtype)
                         : at::zeros(tensor.sizes(), tensor.options().dtype(state_dtype));
    };
    if (options_.kind == OptimizerKind::AdamW) {
      slot.exp_avg = zeros();
      slot.exp_avg_sq = zeros();
    } else if (options_.momentum != 0) {
      slot.momentum_buffer = zeros();
    }
    slots_.push_back(std::move(slot));
  }
}

void Optimizer::step(double lr) {
  at::NoGradGuard no_grad;
  for (auto& slot : slots_) {
    const at::Tensor& grad = slot.param.grad();
    if (!grad.defined()) continue;
    if (options_.kind == OptimizerKind::AdamW)
      adamw_update(slot, grad, lr);
    else
      sgd_update(slot, grad, lr);
  }
  ++steps_taken_;
}

// torch/optim/adam.py _single_tensor_adam (capturable=False, amsgrad=False, maximize=False), op for op, with one
// reordering that cannot change a bit: the decay of the parameter moves after the moment updates, which never read
// the parameter. The temporaries are one at a time where torch holds two: denom is made in place
// (sqrt, div_, add_ equal torch's sqrt() / c then add_ bit for bit: the same kernels, checked by the oracle).
void Optimizer::adamw_update(Slot& slot, const at::Tensor& grad, double lr) {
  const auto dtype = slot.exp_avg.scalar_type();
  const auto& o = options_;
  ++slot.steps;
  // torch keeps the step in a float32 tensor and reads it with .item(): the same double below 2^24 steps. The
  // scalars are Python floats; std::pow is the libm pow that Python's ** calls (including bias_correction2 ** 0.5,
  // which is not always sqrt).
  const double step = double(slot.steps);
  const double bias_correction1 = 1 - std::pow(o.beta1, step);
  const double bias_correction2 = 1 - std::pow(o.beta2, step);
  const double step_size = lr / bias_correction1;
  const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
  {
    const at::Tensor g = where_states_are(grad, dtype, slot.exp_avg);
    slot.exp_avg.lerp_(g, 1 - o.beta1);
    slot.exp_avg_sq.mul_(py_float(o.beta2)).addcmul_(g, g, 1 - o.beta2);
  }
  // The rest a slice at a time (kUpdateSlice): denom and the parameter's converted copy are a slice, not a copy of
  // the largest tensor.
  const auto update = [&](const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq) {
    at::Tensor denom = exp_avg_sq.sqrt();
    denom.div_(py_float(bias_correction2_sqrt));  // two statements: one wrapped scalar alive at a time
    denom.add_(py_float(o.eps));
    const at::Tensor p = where_states_are(param, dtype, exp_avg);
    if (slot.weight_decay != 0) p.mul_(py_float(1 - lr * slot.weight_decay));
    p.addcdiv_(exp_avg, denom, -step_size);
    if (!p.is_same(param)) param.copy_(p);
  };
  for_each_update_slice(slot.param, slot.exp_avg, slot.exp_avg_sq, update);
}

// torch/optim/sgd.py _single_tensor_sgd (dampening 0, nesterov=False, maximize=False). torch clones the gradient
// into a new buffer at the first update; ours exists from the start and is copied into.
void Optimizer::sgd_update(Slot& slot, const at::Tensor& grad, double lr) {
  constexpr double dampening = 0;
  const auto dtype = state_dtype_of(options_, slot.param.scalar_type());
  const at::Tensor p = where_states_are(slot.param, dtype, slot.momentum_buffer);
  at::Tensor g = where_states_are(grad, dtype, slot.momentum_buffer);
  if (slot.weight_decay != 0) g = g.add(p, slot.weight_decay);
  if (options_.momentum != 0) {
    if (slot.steps == 0)
      slot.momentum_buffer.copy_(g);
    else
      slot.momentum_buffer.mul_(py_float(options_.momentum)).add_(g, 1 - dampening);
    g = slot.momentum_buffer;
  }
  p.add_(g, -lr);
  ++slot.steps;
  if (!p.is_same(slot.param)) slot.param.copy_(p);
}

TensorList Optimizer::state() const {
  TensorList out{{"step", at::scalar_tensor(steps_taken_, at::kLong)}};
  for (const auto& s : slots_) {
    out.push_back({s.name + ".step", at::scalar_tensor(s.steps, at::kLong)});
    if (s.exp_avg.defined()) out.push_back({s.name + ".exp_avg", s.exp_avg});
    if (s.exp_avg_sq.defined()) out.push_back({s.name + ".exp_avg_sq", s.exp_avg_sq});
    if (s.momentum_buffer.defined()) out.push_back({s.name + ".momentum_buffer", s.momentum_buffer});
  }
  return out;
}

void Optimizer::load_state(const TensorList& state, const std::string& source) {
  const auto fail = [&](const std::string& name, const std::string& what) {
    throw InputError("optimizer state '" + source + "': tensor '" + name + "' " + what);
  };
  std::map<std::string, at::Tensor> given;
  for (const auto& [name, tensor] : state)
    if (!given.emplace(name, tensor).second) fail(name, "appears twice");
  const auto expected = this->state();
  std::set<std::string> known;
  for (const auto& [name, mine] : expected) {
    known.insert(name);
    const auto it = given.find(name);
    if (it == given.end()) fail(name, "is missing (optimizer " + optimizer_spec(options_) + ")");
    const at::Tensor& t = it->second;
    if (t.scalar_type() != mine.scalar_type())
      fail(name, std::string("has dtype ") + c10::toString(t.scalar_type()) + ", expected " +
                     c10::toString(mine.scalar_type()));
    if (t.sizes() != mine.sizes())
      fail(name, "has shape " + shape_list(t.sizes()) + ", expected " + shape_list(mine.sizes()));
  }
  for (const auto& [name, tensor] : given)
    if (!known.count(name)) fail(name, "is not a state of this optimizer (" + optimizer_spec(options_) + ")");
  const auto steps = given.at("step").item<std::int64_t>();
  if (steps < 0) fail("step", "is negative");
  for (const auto& s : slots_) {
    const auto own = given.at(s.name + ".step").item<std::int64_t>();
    if (own < 0 || own > steps)
      fail(s.name + ".step", "is " + std::to_string(own) + ", outside [0, step = " + std::to_string(steps) + "]");
  }
  at::NoGradGuard no_grad;
  steps_taken_ = steps;
  for (auto& s : slots_) {
    s.steps = given.at(s.name + ".step").item<std::int64_t>();
    if (s.exp_avg.defined()) s.exp_avg.copy_(given.at(s.name + ".exp_avg"));
    if (s.exp_avg_sq.defined()) s.exp_avg_sq.copy_(given.at(s.name + ".exp_avg_sq"));
    if (s.momentum_buffer.defined()) s.momentum_buffer.copy_(given.at(s.name + ".momentum_buffer"));
  }
}

std::int64_t Optimizer::state_bytes() const {
  std::int64_t bytes = 0;
  for (const auto& s : slots_)
    for (const auto* t : {&s.exp_avg, &s.exp_avg_sq, &s.momentum_buffer})
      if (t->defined()) bytes += std::int64_t(t->nbytes());
  return bytes;
}

void save_optimizer_state(const Optimizer& optimizer, const std::filesystem::path& file) {
  save_optimizer_state(optimizer.options(), optimizer.state(), file);
}

void save_optimizer_state(const OptimizerOptions& o, const TensorList& state, const std::filesystem::path& file) {
  const auto state_dtype = o.state_dtype == c10::ScalarType::Undefined ? "param" : dtype_name(o.state_dtype);
  write_safetensors(file, state, {{"format", "pt"}, {"optimizer", optimizer_spec(o)}, {"state_dtype", state_dtype}});
}

void load_optimizer_state(Optimizer& optimizer, const std::filesystem::path& file) {
  optimizer.load_state(read_safetensors(file), file.string());
}

OptimizerMemory optimizer_memory(const OptimizerOptions& options, const std::vector<ParamShape>& params) {
  check_options(options);
  OptimizerMemory memory;
  const bool adamw = options.kind == OptimizerKind::AdamW;
  for (const auto& param : params) {
    std::int64_t numel = 1;
    for (const auto n : param.shape) numel *= n;
    const auto state_dtype = state_dtype_of(options, param.dtype);
    const std::int64_t tensor = numel * std::int64_t(c10::elementSize(state_dtype));  // one tensor in state dtype
    // Copies of the gradient and the parameter in the state dtype (none on torch's path: same dtype).
    const std::int64_t converted = state_dtype == param.dtype ? 0 : tensor;
    const bool decay = decays_weight(options, param.name);
    const std::int64_t scalar = wrapped_scalar_bytes(state_dtype);
    std::int64_t peak = 0;
    if (adamw) {
      memory.state_bytes += 2 * tensor;
      // g converted (exp_avg_sq.mul_ wraps a scalar meanwhile); then, a slice at a time, denom (div_, add_ wrap
      // theirs); then denom and the converted parameter (its decay mul_ wraps one).
      const auto slice = update_slice_elements(numel) * std::int64_t(c10::elementSize(state_dtype));
      const std::int64_t converted_slice = converted ? slice : 0;
      peak = std::max({converted + scalar, slice + scalar,
                       slice + converted_slice + (decay && converted ? scalar : 0)});
    } else {
      const bool momentum = options.momentum != 0;
      if (momentum) memory.state_bytes += tensor;
      // p and g converted; g + wd*p a new tensor while g still lives; the buffer's mul_ wraps a scalar (from the
      // second update on) while the gradient in use lives.
      std::int64_t live_grad = converted;
      peak = 2 * converted;
      if (decay) {
        peak = std::max(peak, 2 * converted + tensor);
        live_grad = tensor;
      }
      if (momentum) peak = std::max(peak, converted + live_grad + scalar);
    }
    memory.step_temporary_bytes = std::max(memory.step_temporary_bytes, peak);
  }
  return memory;
}

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm) {
  at::NoGradGuard no_grad;
  std::vector<std::optional<at::Tensor>> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.emplace_back(p.grad());
  if (grads.empty()) return 0.0;  // torch: tensor(0.), nothing scaled
  // torch groups by (device, dtype) with this very function (torch._C._group_tensors_by_device_and_dtype), and the
  // order of the groups (an unordered_map's) is the order of the norms in the stack: calling it reproduces it.
  const auto grouped = at::native::_group_tensors_by_first_tensors_device_and_dtype({grads}, false);
  std::vector<std::vector<at::Tensor>> groups;
  std::vector<at::Tensor> norms;
  for (const auto& [device_and_dtype, tensors_and_indices] : grouped) {
    auto& group = groups.emplace_back();
    for (const auto& g : tensors_and_indices.first[0]) group.push_back(*g);
    // CPU has foreach support in clip_grad.py (_device_has_foreach_support): torch._foreach_norm, each norm in its
    // tensor's dtype.
    for (auto& n : at::_foreach_norm(group, 2.0)) norms.push_back(std::move(n));
  }
  const at::Tensor total_norm = at::linalg_vector_norm(at::stack(norms), 2.0);  // promoted dtype of the norms
  // Python's `max_norm / (total_norm + 1e-6)` is Tensor.__rdiv__: reciprocal() * max_norm, two roundings in the
  // norm's dtype.
  const at::Tensor clip_coef = total_norm.add(py_float(1e-6)).reciprocal().mul(py_float(max_norm));
  const at::Tensor clip_coef_clamped = at::clamp(clip_coef, std::nullopt, std::optional<at::Scalar>(1.0));
  for (auto& group : groups) at::_foreach_mul_(group, clip_coef_clamped);
  return total_norm.item<double>();
}

}  // namespace sbp
