#include "verify/grad_compare.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <fmt/format.h>

namespace sbp {

std::string module_group(const std::string& name) {
  auto has = [&](const char* part) { return name.find(part) != std::string::npos; };
  if (has("embed_tokens") || has("lm_head")) return "embedding/head";
  if (has("norm")) return "norms";
  if (has("self_attn")) return "attention";
  if (has("mlp")) return "mlp";
  return "other";
}

double unit_roundoff(c10::ScalarType dtype) {
  if (dtype == at::kBFloat16) return double(std::numeric_limits<c10::BFloat16>::epsilon()) / 2;
  if (dtype == at::kHalf) return double(std::numeric_limits<c10::Half>::epsilon()) / 2;
  if (dtype == at::kFloat) return double(std::numeric_limits<float>::epsilon()) / 2;
  return double(std::numeric_limits<double>::epsilon()) / 2;
}

double low_precision_floor(const GradComparison& standard, const TensorError& tensor, c10::ScalarType dtype) {
  if (tensor.l2_scale <= 0) return unit_roundoff(dtype);  // an all-zero model: no scale to be relative to
  return unit_roundoff(dtype) * standard.floor * std::sqrt(double(tensor.numel)) / tensor.l2_scale;
}

namespace {

// The regularized incomplete beta function I_x(a, b), by its continued fraction evaluated with the modified Lentz
// method. The fraction converges fast for x < (a + 1) / (a + b + 2); above that, I_x(a, b) = 1 - I_{1-x}(b, a).
double incomplete_beta(double a, double b, double x) {
  if (x <= 0) return 0;
  if (x >= 1) return 1;
  if (x > (a + 1) / (a + b + 2)) return 1 - incomplete_beta(b, a, 1 - x);
  const double log_front = std::lgamma(a + b) - std::lgamma(a) - std::lgamma(b) + a * std::log(x) + b * std::log1p(-x);
  constexpr double kTiny = 1e-300;
  // 1 / (1 + d_1 / (1 + d_2 / (1 + ...))): d_{2m+1} = -(a+m)(a+b+m)x / ((a+2m)(a+2m+1)), d_{2m} = m(b-m)x / ((a+2m-1)(a+2m)).
  double f = 1, c = 1, d = 0;
  for (int i = 0; i < 1000000; ++i) {
    const double m = double(i / 2);
    const double term = i == 0       ? 1.0
                        : i % 2 == 0 ? m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
                                     : -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1));
    d = 1 + term * d;
    d = 1 / (std::abs(d) < kTiny ? kTiny : d);
    c = 1 + term / c;
    if (std::abs(c) < kTiny) c = kTiny;
    f *= c * d;
    if (std::abs(c * d - 1) < 1e-15) break;
  }
  return std::exp(log_front) * (f - 1) / a;
}

}  // namespace

double noise_ratio_quantile(double n, double alpha) {
  TORCH_CHECK(alpha > 0 && alpha < 0.5, "noise_ratio_quantile: alpha must lie in (0, 0.5), got ", alpha);
  // F(n, n) / (1 + F(n, n)) is Beta(n/2, n/2): find its upper alpha-quantile x by bisection (the tail is monotone),
  // then F = x / (1 - x) and the l2 ratio is sqrt(F).
  const double a = std::max(n, 1.0) / 2;
  double lo = 0.5, hi = 1.0;
  for (int i = 0; i < 200 && hi - lo > 1e-16; ++i) {
    const double mid = (lo + hi) / 2;
    (1 - incomplete_beta(a, a, mid) > alpha ? lo : hi) = mid;
  }
  return std::sqrt(hi / (1 - hi));
}

double low_precision_noise_scale(c10::ScalarType dtype) { return dtype == at::kFloat ? 3.0 : 2.5; }

double gaussian_quantile(double alpha) {
  TORCH_CHECK(alpha > 0 && alpha < 1, "gaussian_quantile: alpha must lie in (0, 1), got ", alpha);
  // P(|N(0,1)| > z) = erfc(z / sqrt 2) falls monotonically: bisect.
  double lo = 0, hi = 40;
  for (int i = 0; i < 200 && hi - lo > 1e-14; ++i) {
    const double mid = (lo + hi) / 2;
    (std::erfc(mid / std::sqrt(2.0)) > alpha ? lo : hi) = mid;
  }
  return hi;
}

double low_precision_allowance(const TensorError& tensor, c10::ScalarType dtype, double noise_scale) {
  const double n = tensor.effective_entries > 0 ? tensor.effective_entries : double(std::max<std::int64_t>(tensor.numel, 1));
  return (noise_scale > 0 ? noise_scale : low_precision_noise_scale(dtype)) *
         noise_ratio_quantile(n, kLowPrecisionFalseFailure);
}

double common_scale(const GradComparison& c) {
  double along = 0, energy = 0;
  for (const auto& t : c.tensors)
    if (t.finite()) along += t.error_along, energy += t.energy;
  return energy > 0 ? along / energy : 0;
}

double run_error(const GradComparison& c) {
  double error = 0, scale = 0;
  for (const auto& t : c.tensors)
    if (t.finite()) error += t.error_energy, scale += t.l2_scale * t.l2_scale;
  return scale > 0 ? std::sqrt(error / scale) : 0;
}

namespace {

// A NaN statistic (a NaN gradient) must fail and win every comparison: make it +inf.
double finite_or_inf(double x) { return x == x ? x : std::numeric_limits<double>::infinity(); }

// ||e - r a|| / l2_scale from the tensor's sums; an infinite or NaN error stays infinite.
double error_beside_scale(const TensorError& t, double r) {
  if (!(t.l2_rel < std::numeric_limits<double>::infinity())) return std::numeric_limits<double>::infinity();
  if (t.l2_scale <= 0) return 0;
  const double squared = t.error_energy - 2 * r * t.error_along + r * r * t.energy;
  return std::sqrt(std::max(squared, 0.0)) / t.l2_scale;
}

}  // namespace

RuleVerdict low_precision_rule(const GradComparison& standard, const GradComparison& method, c10::ScalarType dtype,
                               double noise_scale) {
  TORCH_CHECK(standard.tensors.size() == method.tensors.size(), "low_precision_rule: different tensor lists");
  const double scale_factor = noise_scale > 0 ? noise_scale : low_precision_noise_scale(dtype);
  const double r_method = common_scale(method), r_standard = common_scale(standard);
  RuleVerdict v;
  for (std::size_t i = 0; i < method.tensors.size(); ++i) {
    const auto& m = method.tensors[i];
    const auto& s = standard.tensors[i];
    TORCH_CHECK(m.name == s.name, "low_precision_rule: ", m.name, " vs ", s.name);
    RuleJudgement j{m.name, s.effective_entries, error_beside_scale(m, r_method), error_beside_scale(s, r_standard),
                    low_precision_floor(standard, s, dtype), low_precision_allowance(s, dtype, scale_factor)};
    // A non-finite entry in the oracle, the baseline or the method fails the tensor: an infinite standard error
    // would otherwise make any error pass.
    j.statistic = m.finite() && s.finite() ? finite_or_inf(j.method_error / (j.allowance * j.standard_error + j.floor))
                                           : std::numeric_limits<double>::infinity();
    v.tensors.push_back(j);
  }
  for (const auto* c : {&standard, &method})
    for (const auto& p : c->problems)
      if (std::find(v.problems.begin(), v.problems.end(), p) == v.problems.end()) v.problems.push_back(p);
  const double r = std::abs(r_method);
  v.scale = {kCommonScale, 1, r, run_error(standard), unit_roundoff(dtype),
             scale_factor * gaussian_quantile(kLowPrecisionFalseFailure)};
  v.scale.statistic = finite_or_inf(r / (v.scale.allowance * v.scale.standard_error + v.scale.floor));
  const RuleJudgement* worst = &v.scale;
  for (const auto& j : v.tensors)
    if (j.statistic > worst->statistic) worst = &j;
  v.worst_ratio = worst->statistic;
  v.worst_tensor = worst->name;
  v.method_error = worst->method_error;
  v.standard_error = worst->standard_error;
  v.allowance = worst->allowance;
  v.effective_entries = worst->effective_entries;
  return v;
}

double GradComparison::max_normwise_rel() const {
  const auto* w = worst();
  return w ? w->normwise_rel : 0;
}

const TensorError* GradComparison::worst() const {
  const TensorError* w = nullptr;
  for (const auto& t : tensors)
    if (!w || t.normwise_rel > w->normwise_rel) w = &t;
  return w;
}

namespace {

// A tensor's NaN and Inf entries, as a problem says them ("1 NaN entry", "2 NaN and 3 Inf entries").
struct NonFinite {
  std::int64_t nan = 0, inf = 0;
  explicit NonFinite(const at::Tensor& t)
      : nan(at::isnan(t).sum().item<std::int64_t>()), inf(at::isinf(t).sum().item<std::int64_t>()) {}
  std::int64_t count() const { return nan + inf; }
  std::string words() const {
    const auto both = nan > 0 && inf > 0 ? fmt::format("{} NaN and {} Inf", nan, inf)
                                         : nan > 0 ? fmt::format("{} NaN", nan) : fmt::format("{} Inf", inf);
    return both + (count() == 1 ? " entry" : " entries");
  }
};

}  // namespace

GradComparison compare_gradients(const TensorList& ref, const TensorList& other, const GradInputs& inputs) {
  GradComparison out;
  // The model-wide scale of the degenerate floor, over finite entries: an Inf would make every tensor degenerate and
  // every error vanish beside an infinite floor.
  for (const auto& r : ref)
    if (r.tensor.numel() > 0)
      out.global_max_abs = std::max(out.global_max_abs,
                                    r.tensor.to(at::kDouble).abs().nan_to_num(0, 0, 0).max().item<double>());
  out.floor = kDegenerateFraction * out.global_max_abs;
  std::map<std::string, at::Tensor> others;
  for (const auto& t : other) others[t.name] = t.tensor;
  for (const auto& r : ref) {
    auto it = others.find(r.name);
    if (it == others.end()) {
      out.problems.push_back("tensor '" + r.name + "' is missing in " + inputs.other);
      continue;
    }
    if (it->second.sizes() != r.tensor.sizes()) {
      out.problems.push_back("tensor '" + r.name + "' has shape " + c10::str(it->second.sizes()) + ", reference " +
                             c10::str(r.tensor.sizes()));
      others.erase(it);
      continue;
    }
    const auto a = r.tensor.to(at::kDouble), b = it->second.to(at::kDouble);
    others.erase(it);
    const NonFinite ref_bad(a), other_bad(b);
    for (const auto& [bad, input] : {std::pair{&ref_bad, &inputs.ref}, {&other_bad, &inputs.other}})
      if (bad->count() > 0) out.problems.push_back("tensor '" + r.name + "' has " + bad->words() + " in " + *input);
    const auto diff = (a - b).abs();
    TensorError e;
    e.name = r.name;
    e.group = module_group(r.name);
    e.numel = a.numel();
    e.nonfinite_ref = ref_bad.count();
    e.nonfinite_other = other_bad.count();
    if (e.numel > 0) {
      e.max_abs = diff.max().item<double>();
      e.er_abs = diff.mean().item<double>();
      e.er_rel = (diff / (a.abs() + 1e-10)).mean().item<double>();
      e.ref_max_abs = a.abs().max().item<double>();
      e.degenerate = e.ref_max_abs < out.floor;
      const double scale = std::max(e.ref_max_abs, out.floor);
      e.normwise_rel = scale > 0 ? e.max_abs / scale : (e.max_abs > 0 ? std::numeric_limits<double>::infinity() : 0);
      const auto squares = a.square();
      const double energy = squares.sum().item<double>();
      const double fourth = squares.square().sum().item<double>();
      e.effective_entries = fourth > 0 ? energy * energy / fourth : double(e.numel);
      const double err = diff.square().sum().item<double>();
      e.energy = energy;
      e.error_energy = err;
      e.error_along = ((b - a) * a).sum().item<double>();
      e.nmse = energy > 0 ? err / energy : (err > 0 ? std::numeric_limits<double>::infinity() : 0);
      e.l2_scale = std::max(std::sqrt(energy), out.floor * std::sqrt(double(e.numel)));
      e.l2_rel = e.l2_scale > 0 ? std::sqrt(err) / e.l2_scale : (err > 0 ? std::numeric_limits<double>::infinity() : 0);
      // A comparison with NaN is false, so a NaN metric would pass every gate: a non-finite input, or a metric that
      // overflowed, is +inf.
      if (!e.finite() || !(e.normwise_rel == e.normwise_rel)) e.normwise_rel = std::numeric_limits<double>::infinity();
      if (!e.finite() || !(e.l2_rel == e.l2_rel)) e.l2_rel = std::numeric_limits<double>::infinity();
    }
    out.tensors.push_back(e);
  }
  for (const auto& [name, t] : others) out.problems.push_back("tensor '" + name + "' is missing in " + inputs.ref);
  return out;
}

}  // namespace sbp
