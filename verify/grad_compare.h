// Gradient-equivalence metrics (DESIGN §8), per parameter tensor, computed in fp64:
//   max_abs = max|a-b|, er_abs = mean|a-b| (paper's Er_abs), er_rel = mean |a-b| / (|a| + 1e-10) (paper's Er_rel),
//   normwise_rel = max|a-b| / max|a| (the gate), nmse = sum (a-b)² / sum a².
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/safetensors.h"

namespace sbp {

struct TensorError {
  std::string name;
  std::string group;  // "embedding/head", "attention", "mlp", "norms"
  std::int64_t numel = 0;
  double max_abs = 0, er_abs = 0, er_rel = 0, normwise_rel = 0, nmse = 0;
};

struct GradComparison {
  std::vector<TensorError> tensors;
  std::vector<std::string> problems;  // missing tensors, shape mismatches: each fails the comparison
  double max_normwise_rel() const;
  const TensorError* worst() const;   // largest normwise_rel, or nullptr
  bool passed(double rtol) const { return problems.empty() && max_normwise_rel() <= rtol; }
};

std::string module_group(const std::string& hf_name);
// `ref` is the reference (e.g. standard BP); every tensor of either side must have a partner of the same shape.
GradComparison compare_gradients(const TensorList& ref, const TensorList& other);

}  // namespace sbp
