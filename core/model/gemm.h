// Matrix products of a narrow float dtype (bf16, fp16), on the path that is fast on the running machine (issue #28).
//
// A CPU without native bf16 GEMM kernels runs ATen's bf16 products as a scalar loop: on an AVX2-only EPYC the input
// gradient [4096, 1536] x [1536, 512] took 8.15 s against 0.052 s in fp32, and a bf16 training step of qwen3-small at
// T = 4096 did not finish in 13 minutes where fp32 takes 31 s. oneDNN's emulated kernels (AVX512_CORE) are 4-7x
// slower than fp32, and even native AVX512-BF16 kernels are slower than fp32 for some operand layouts. The other path
// is fp32 arithmetic on widened operands with the product rounded once into the narrow dtype: the arithmetic of a bf16
// GEMM with fp32 accumulation, which is what the native kernels compute too (results differ by accumulation order,
// i.e. rounding noise, judged by the low-precision rule like any other reordering).
//
// Each operand layout (the forward x·Wᵀ, the input gradient g·W, the weight gradient gᵀ·x) takes its own path,
// chosen once per process and dtype by timing both on a probe product: widened when the native kernel is more than
// twice as slow (the cases that matter are 4x to 150x; a narrower margin could flip between runs of one machine).
// STREAMBP_NARROW_GEMM=native|widened pins every layout instead, and a resumed training run pins the paths its
// checkpoint recorded, so that a resumed run continues with the arithmetic it started with. fp32/fp64 and tensors on
// a GPU are never widened.
#pragma once

#include <map>
#include <string>

#include <ATen/core/Tensor.h>

namespace sbp {

enum class GemmLayout { nt, nn, tn };  // x·Wᵀ (forward), g·W (input gradient), gᵀ·x (weight gradient)
enum class GemmPath { native, widened };

struct GemmPaths {
  GemmPath nt = GemmPath::native, nn = GemmPath::native, tn = GemmPath::native;
  GemmPath of(GemmLayout layout) const;
  std::string describe() const;  // "nt=native,nn=widened,tn=widened"
  bool any_widened() const { return nt == GemmPath::widened || nn == GemmPath::widened || tn == GemmPath::widened; }
};

// The paths of `dtype` in this process (all native for fp32/fp64), measured on first use unless pinned.
const GemmPaths& gemm_paths(c10::ScalarType dtype);
// What the choice was based on, for the run record: "measured: nt native 1.2 ms / widened 1.0 ms, ...", "pinned by
// STREAMBP_NARROW_GEMM=widened", "pinned by the checkpoint"; "" for a dtype that is never widened.
std::string gemm_paths_reason(c10::ScalarType dtype);
// Every narrow dtype whose paths this process has chosen so far: its name ("bf16") -> {paths, reason}.
std::map<std::string, std::pair<std::string, std::string>> chosen_gemm_paths();
// Pins the paths of `dtype` (a resumed run: the paths its checkpoint recorded). Throws std::invalid_argument naming
// `source` on a malformed description.
void pin_gemm_paths(c10::ScalarType dtype, const std::string& description, const std::string& source);

// Whether a product of `a` (its dtype and device) in `layout` takes the widened path: only narrow dtypes on the CPU
// (a GPU's bf16 kernels are its fast path).
bool widened(const at::Tensor& a, GemmLayout layout);
// a [m, k] · b [k, n] in a's dtype; `layout` names which of the model's products this is (its path).
at::Tensor gemm(const at::Tensor& a, const at::Tensor& b, GemmLayout layout);
// y = x · wᵀ + bias (x [..., k], w [n, k], bias [n] or undefined), differentiable; the backward's products take
// their own layouts' paths. With every path native this is at::linear itself.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias = {});

}  // namespace sbp
