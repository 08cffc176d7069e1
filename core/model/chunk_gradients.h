// Gradients summed over the chunks of a streamed layer or head, rounded once into the parameters' grad. Below the
// model because it is a tensor sum that knows nothing of methods: the model's hand-written head backward uses it too.
#pragma once

#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

namespace sbp {

// Sums parameter gradients over chunks and writes them into the parameters' grad once (ARCHITECTURE.md §4 "Precision").
// In bf16 a streamed gradient summed chunk by chunk in bf16 would round once per chunk, so its error would grow with
// the chunk count; here each chunk's contribution (rounded once, by its own GEMM, like standard BP's single GEMM) is
// added into an fp32 buffer that lives for one layer or the head stage, and rounded into the bf16 grad at commit().
// For fp32/fp64 parameters the sum is kept in their own dtype: no buffer beyond the gradient itself.
class ChunkGradients {
 public:
  // The dtype a parameter's chunk contributions are summed in, given theirs (by default accumulation_dtype).
  using SumDtype = std::function<c10::ScalarType(c10::ScalarType)>;
  explicit ChunkGradients(std::vector<at::Tensor> params, SumDtype sum_dtype = &ChunkGradients::accumulation_dtype);
  const std::vector<at::Tensor>& params() const { return params_; }
  // One contribution per parameter, aligned with params() (undefined: none from this chunk).
  void add(at::ArrayRef<at::Tensor> grads);
  // Adds the sums into the parameters' grad (creating it), in the parameters' dtype.
  void commit();
  // The accumulation dtype for a model dtype: fp32 for bf16/fp16, else the dtype itself.
  static c10::ScalarType accumulation_dtype(c10::ScalarType dtype);

 private:
  std::vector<at::Tensor> params_, sums_;
  SumDtype sum_dtype_;
};

}  // namespace sbp
