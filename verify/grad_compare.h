// Gradient-equivalence metrics (DESIGN §8), per parameter tensor, computed in fp64:
//   max_abs = max|a-b|, er_abs = mean|a-b| (paper's Er_abs), er_rel = mean |a-b| / (|a| + 1e-10) (paper's Er_rel),
//   normwise_rel = max|a-b| / max(max|a|, floor) (the fp64 exactness gate), nmse = sum (a-b)² / sum a²,
//   l2_rel = ||a-b||₂ / max(||a||₂, floor·sqrt(numel)) (the low-precision rule: see below).
// The low-precision rule compares two methods' errors on the same tensor (a method's <= k x standard BP's). Both
// are rounding noise there, and the ratio of two maxima over a few entries is itself noisy: on the 64-entry k_norm
// gradients of tiny/qwen3-small the max-norm ratio of exact methods reached 1.05x the 1.5x-standard allowance in bf16
// and 1.2x the 2x allowance in fp32, where the whole-tensor l2 ratio stays below 0.7.
// A tensor whose true gradient is zero or at rounding level (e.g. B = 1, T = 2: q/k gradients vanish) makes every
// relative metric compare noise with noise. Such a tensor — max|a| below kDegenerateFraction of the largest gradient
// entry of the whole reference — is judged against that floor instead of its own scale, and flagged `degenerate`:
// an exact method passes it, a perturbation of 1e-3 of the global maximum fails it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include "core/io/safetensors.h"

namespace sbp {

constexpr double kDegenerateFraction = 1e-4;

struct TensorError {
  std::string name;
  std::string group;  // "embedding/head", "attention", "mlp", "norms"
  std::int64_t numel = 0;
  double max_abs = 0, er_abs = 0, er_rel = 0, normwise_rel = 0, nmse = 0, l2_rel = 0;
  double ref_max_abs = 0;   // max|a|: the tensor's own scale
  double l2_scale = 0;      // l2_rel's denominator: max(||a||_2, floor * sqrt(numel))
  bool degenerate = false;  // ref_max_abs below the floor: normwise_rel is max|a-b| / floor
};

struct GradComparison {
  std::vector<TensorError> tensors;
  double global_max_abs = 0;  // the largest |a| over every reference tensor
  double floor = 0;           // kDegenerateFraction * global_max_abs
  std::vector<std::string> problems;  // missing tensors, shape mismatches: each fails the comparison
  double max_normwise_rel() const;
  const TensorError* worst() const;   // largest normwise_rel, or nullptr
  bool passed(double rtol) const { return problems.empty() && max_normwise_rel() <= rtol; }
};

// Unit roundoff u of a dtype: the error of merely storing an exact value in it.
double unit_roundoff(c10::ScalarType dtype);

// The low-precision rule (DESIGN §8): on every tensor, a method's l2 error against the oracle is at most
// factor x standard BP's in the same dtype + a floor. Both comparisons are against the same oracle, tensor for tensor.
// The floor is the error of storing every entry at the model's rounding floor (kDegenerateFraction of the largest
// gradient entry): u x floor x sqrt(numel) in absolute terms, u x floor x sqrt(numel) / l2_scale relative to the
// tensor. On a degenerate tensor that is u (its gradient is noise, only an absolute bound means anything); on a
// tensor of real size it fades with the tensor's own scale (tiny and a 4-layer d = 128 model in bf16, T = 512: at
// most 1.2% of standard's error, 0.3% typical). The former floor, u itself on every tensor, was 20-90% of
// standard-bf16's own error there (4.4e-3 to 2e-2, i.e. 1.1u to 5u): it turned the 1.5x bar into up to 2.4x and
// passed issue #18's reported 1.85x tensor (1.34e-2 against 7.2e-3).
struct RuleVerdict {
  double worst_ratio = 0;   // max over tensors of error / (factor x standard's error + floor): <= 1 passes
  std::string worst_tensor;
  double method_error = 0, standard_error = 0;  // the worst tensor's l2 errors
  bool passed() const { return worst_ratio <= 1; }
};
RuleVerdict low_precision_rule(const GradComparison& standard, const GradComparison& method, double factor,
                               c10::ScalarType dtype);
// The rule's floor for one tensor of `standard` (relative, like l2_rel).
double low_precision_floor(const GradComparison& standard, const TensorError& tensor, c10::ScalarType dtype);

std::string module_group(const std::string& hf_name);
// `ref` is the reference (e.g. standard BP); every tensor of either side must have a partner of the same shape.
GradComparison compare_gradients(const TensorList& ref, const TensorList& other);

}  // namespace sbp
