// Gradient-equivalence metrics (ARCHITECTURE.md §8), per parameter tensor, computed in fp64:
//   max_abs = max|a-b|, er_abs = mean|a-b| (paper's Er_abs), er_rel = mean |a-b| / (|a| + 1e-10) (paper's Er_rel),
//   normwise_rel = max|a-b| / max(max|a|, floor) (the fp64 exactness gate), nmse = sum (a-b)² / sum a²,
//   l2_rel = ||a-b||₂ / max(||a||₂, floor·sqrt(numel)) (the low-precision rule: see below).
// The low-precision rule (below) compares two methods' whole-tensor l2 errors, never their largest entries: the ratio of
// two maxima over a few entries is noisier still (on 64-entry k_norm gradients it reached 1.05x a 1.5x allowance).
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
  double effective_entries = 0;  // (sum a^2)^2 / sum a^4: how many entries carry the energy (numel if all are equal)
  // Sums behind the low-precision rule's split of the error e = b - a into the run's common scale and the rest:
  double energy = 0;          // sum a^2
  double error_energy = 0;    // sum e^2
  double error_along = 0;     // sum e a: the error's projection on the reference
  bool degenerate = false;  // ref_max_abs below the floor: normwise_rel is max|a-b| / floor
  // NaN or Inf entries of either input (issue #44): such a tensor fails every verdict, whichever input holds them.
  // Its normwise_rel and l2_rel are +inf (a comparison with NaN is false and would pass).
  std::int64_t nonfinite_ref = 0, nonfinite_other = 0;
  bool finite() const { return nonfinite_ref == 0 && nonfinite_other == 0; }
};

struct GradComparison {
  std::vector<TensorError> tensors;
  double global_max_abs = 0;  // the largest |a| over every reference tensor
  double floor = 0;           // kDegenerateFraction * global_max_abs
  std::vector<std::string> problems;  // missing tensors, shape mismatches, non-finite entries: each fails it
  double max_normwise_rel() const;
  const TensorError* worst() const;   // largest normwise_rel, or nullptr
  bool passed(double rtol) const { return problems.empty() && max_normwise_rel() <= rtol; }
};

// Unit roundoff u of a dtype: the error of merely storing an exact value in it.
double unit_roundoff(c10::ScalarType dtype);

// The low-precision rule (fp32, bf16, bf16-mixed): a method's rounding noise may be at most noise_scale(dtype) times
// standard BP's in the same dtype, judged against the fp64 oracle on the same weights, in two parts.
//
// Why two parts. A method's error e = g - g_oracle has a component shared by every tensor at once: a relative scale
// r = sum <e, a> / sum |a|^2 over the whole run (a = the oracle's gradients), which comes from scalars every gradient is
// multiplied by — DPO's coefficient beta (1 - sigmoid(beta l)) from the run's own log-probs, a loss normaliser. For an
// exact method r is a single draw of rounding for the whole run (measured: a StreamBP DPO run at 64 chunks with r = -4e-3
// where standard's was +7.5e-4, its per-entry error typical), so a per-tensor test that counts every tensor's entries as
// independent cannot bound it. The rule therefore judges
//   1. each tensor's error beside the common scale, e - r a, against standard's e_s - r_s a, and
//   2. the common scale r itself against standard's whole-run error.
//
// Part 1. e_perp = ||e - r a|| / ||a|| (whole-tensor l2) for the method and for standard BP. For two exact methods both
// are draws of rounding noise, and their ratio is a random variable whose spread depends on how many independent entries
// the tensor has: on a 16-entry k_norm gradient the ratio of two such draws exceeded 1.5 on an AVX2 CPU (issue #28), on
// a 10^5-entry MLP weight it stays within a few percent of its mean. A fixed factor is therefore too strict on small
// tensors and too loose on large ones, and whichever CPU runs the test decides.
// The model behind the allowance: the n errors of a tensor are independent and of one scale per method (sigma_m,
// sigma_s). Then (e_m / e_s)^2 = (sigma_m / sigma_s)^2 F(n, n), F the F-distribution, and the largest ratio an exact
// method whose noise is noise_scale x standard's reaches with probability kLowPrecisionFalseFailure is
//     allowance(n) = noise_scale(dtype) x noise_ratio_quantile(n, kLowPrecisionFalseFailure).
// n is the tensor's effective entry count, the participation ratio (sum a^2)^2 / sum a^4 of the oracle's entries:
// rounding noise scales with each entry's size, so a tensor whose energy sits in a few entries has fewer independent
// draws than entries. With noise_scale 2.5 (bf16): allowance(16) = 9.7, allowance(128) = 3.9, allowance(10^4) = 2.6.
// A floor is added to standard's error: the error of storing every entry at the model's rounding floor
// (kDegenerateFraction of the largest gradient entry), u x floor x sqrt(numel) in absolute terms. On a degenerate tensor
// that is u (its gradient is noise, only an absolute bound means anything); on a tensor of real size it fades with the
// tensor's own scale (at most ~1% of standard-bf16's error on tiny and a 4-layer d = 128 model).
//
// Part 2. r is one number, so no ratio of two draws can judge it (the ratio of two one-entry draws has no useful
// quantile). It is judged against the noise it comes from: an exact method's scalars are rounded like the rest of its
// arithmetic, so its |r| is modelled as a Gaussian draw whose spread is at most noise_scale x standard's whole-run
// relative error E_s = sqrt(sum |e_s|^2 / sum |a|^2) (standard's own |r_s| <= E_s always: it is one component of it):
//     |r| <= noise_scale(dtype) x z(kLowPrecisionFalseFailure) x E_s + u,   z = 4.89 (two-sided Gaussian quantile).
// In bf16 (E_s ~ 3e-3) that admits a common scale error of ~3%, in fp32 ~1e-5: a normaliser off by a fraction of a
// percent is a fault the fp32 and fp64 gates see, not the bf16 one. A doubled head gradient is a scale of order 1.
//
// noise_scale(dtype): how much more rounding noise than standard BP's an exact method may make, derived from the
// measured distribution (results/rule/): 1.5 times the largest noise ratio exact methods reached at the 1e-6 tail (the
// largest statistic times the scale it was measured under), rounded up to a half. bf16/fp16 (and bf16-mixed, judged
// as bf16): 1.64 measured (streamed LoRA A factors of a 4-layer d = 128 model at 64 chunks, ONEDNN_MAX_CPU_ISA=AVX2
// on an AMX Xeon; 1.33 on an AMD EPYC: a streamed method rounds its chunk products where standard BP rounds one
// product), so 2.5. fp32: 1.75 measured (accumulation order alone: a streamed method sums chunk shares in another
// order), so 3. The faults of tests/unit/test_negative_controls.cpp exceed the fp32 allowance by 10^5 and more and the
// bf16 one by at least 8.7x (the doubled head).
constexpr double kLowPrecisionFalseFailure = 1e-6;
double low_precision_noise_scale(c10::ScalarType dtype);

// sqrt of the (1 - alpha) quantile of F(n, n): the ratio of two independent l2 norms of n iid Gaussian entries
// exceeds it with probability alpha. n may be fractional (an effective count); n < 1 is taken as 1.
double noise_ratio_quantile(double n, double alpha);
// The two-sided (1 - alpha) quantile of the standard Gaussian: |N(0, 1)| exceeds it with probability alpha.
double gaussian_quantile(double alpha);
// The rule's factor for one tensor: noise_scale x noise_ratio_quantile(its effective entry count). noise_scale 0:
// low_precision_noise_scale(dtype).
double low_precision_allowance(const TensorError& tensor, c10::ScalarType dtype, double noise_scale = 0);

// One judgement of the rule: a tensor's error beside the common scale (part 1), or the common scale (part 2).
struct RuleJudgement {
  std::string name;              // the tensor, or kCommonScale
  double effective_entries = 0;  // the tensor's (1 for the common scale)
  double method_error = 0;       // part 1: the method's ||e - r a|| / ||a||; part 2: |r|
  double standard_error = 0;     // part 1: standard's ||e_s - r_s a|| / ||a||; part 2: standard's whole-run E_s
  double floor = 0;              // added to allowance x standard_error
  double allowance = 0;          // the factor on standard_error
  double statistic = 0;          // method_error / (allowance x standard_error + floor): <= 1 passes
};
inline constexpr const char* kCommonScale = "(common-scale)";  // one token: scripts read the worst tensor as \S+

struct RuleVerdict {
  std::vector<RuleJudgement> tensors;  // part 1, in the comparison's tensor order
  RuleJudgement scale;                 // part 2
  // The two comparisons' problems (non-finite entries, naming tensor and input), each once: any fails the rule.
  std::vector<std::string> problems;
  // The worst judgement of either part; worst_ratio is the statistic whose distribution results/rule/ records.
  double worst_ratio = 0;
  std::string worst_tensor;
  double method_error = 0, standard_error = 0, allowance = 0, effective_entries = 0;
  bool passed() const { return problems.empty() && worst_ratio <= 1; }
};
// noise_scale 0: the harness's (low_precision_noise_scale); tests of the rule itself may ask another.
RuleVerdict low_precision_rule(const GradComparison& standard, const GradComparison& method, c10::ScalarType dtype,
                               double noise_scale = 0);
// The rule's floor for one tensor of `standard` (relative, like l2_rel).
double low_precision_floor(const GradComparison& standard, const TensorError& tensor, c10::ScalarType dtype);
// A comparison's common relative scale r = sum <e, a> / sum |a|^2 and its whole-run relative error sqrt(sum |e|^2 /
// sum |a|^2) (0 when the reference is all zero), over its finite tensors (a non-finite one fails on its own).
double common_scale(const GradComparison& c);
double run_error(const GradComparison& c);

std::string module_group(const std::string& hf_name);
// What the problems call the two inputs: a file's path, "the fp64 oracle", a run's label.
struct GradInputs {
  std::string ref = "the reference", other = "the second file";
};
// `ref` is the reference (e.g. standard BP); every tensor of either side must have a partner of the same shape, and
// every entry of both must be finite.
GradComparison compare_gradients(const TensorList& ref, const TensorList& other, const GradInputs& inputs = {});

}  // namespace sbp
