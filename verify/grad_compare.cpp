#include "verify/grad_compare.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

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

RuleVerdict low_precision_rule(const GradComparison& standard, const GradComparison& method, double factor,
                               c10::ScalarType dtype) {
  TORCH_CHECK(standard.tensors.size() == method.tensors.size(), "low_precision_rule: different tensor lists");
  RuleVerdict v;
  for (std::size_t i = 0; i < method.tensors.size(); ++i) {
    const auto& m = method.tensors[i];
    const auto& s = standard.tensors[i];
    TORCH_CHECK(m.name == s.name, "low_precision_rule: ", m.name, " vs ", s.name);
    const double ratio = m.l2_rel / (factor * s.l2_rel + low_precision_floor(standard, s, dtype));
    if (ratio > v.worst_ratio || v.worst_tensor.empty())
      v = {ratio, m.name, m.l2_rel, s.l2_rel};
  }
  return v;
}

double GradComparison::max_normwise_rel() const {
  double worst = 0;
  for (const auto& t : tensors) worst = std::max(worst, t.normwise_rel);
  return worst;
}

const TensorError* GradComparison::worst() const {
  const TensorError* w = nullptr;
  for (const auto& t : tensors)
    if (!w || t.normwise_rel > w->normwise_rel) w = &t;
  return w;
}

GradComparison compare_gradients(const TensorList& ref, const TensorList& other) {
  GradComparison out;
  for (const auto& r : ref)
    if (r.tensor.numel() > 0) {
      const double m = r.tensor.abs().max().to(at::kDouble).item<double>();
      if (m == m) out.global_max_abs = std::max(out.global_max_abs, m);
    }
  out.floor = kDegenerateFraction * out.global_max_abs;
  std::map<std::string, at::Tensor> others;
  for (const auto& t : other) others[t.name] = t.tensor;
  for (const auto& r : ref) {
    auto it = others.find(r.name);
    if (it == others.end()) {
      out.problems.push_back("tensor '" + r.name + "' is missing in the second file");
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
    const auto diff = (a - b).abs();
    TensorError e;
    e.name = r.name;
    e.group = module_group(r.name);
    e.numel = a.numel();
    if (e.numel > 0) {
      e.max_abs = diff.max().item<double>();
      e.er_abs = diff.mean().item<double>();
      e.er_rel = (diff / (a.abs() + 1e-10)).mean().item<double>();
      e.ref_max_abs = a.abs().max().item<double>();
      e.degenerate = e.ref_max_abs < out.floor;
      const double scale = std::max(e.ref_max_abs, out.floor);
      e.normwise_rel = scale > 0 ? e.max_abs / scale : (e.max_abs > 0 ? std::numeric_limits<double>::infinity() : 0);
      const double energy = a.square().sum().item<double>();
      const double err = diff.square().sum().item<double>();
      e.nmse = energy > 0 ? err / energy : (err > 0 ? std::numeric_limits<double>::infinity() : 0);
      e.l2_scale = std::max(std::sqrt(energy), out.floor * std::sqrt(double(e.numel)));
      e.l2_rel = e.l2_scale > 0 ? std::sqrt(err) / e.l2_scale : (err > 0 ? std::numeric_limits<double>::infinity() : 0);
      // NaN anywhere must fail the gates: comparisons with NaN are false, so turn it into +inf.
      if (!(e.normwise_rel == e.normwise_rel)) e.normwise_rel = std::numeric_limits<double>::infinity();
      if (!(e.l2_rel == e.l2_rel)) e.l2_rel = std::numeric_limits<double>::infinity();
    }
    out.tensors.push_back(e);
  }
  for (const auto& [name, t] : others) out.problems.push_back("tensor '" + name + "' is missing in the reference file");
  return out;
}

}  // namespace sbp
