// The two-linear-layer example of the paper's appendix A.1 (Table 6), the smallest case of StreamBP's idea:
//   Y = X W1, Z = Y W2, L = sum(Z ∘ G)       X: [N, m], W1: [m, n], W2: [n, k], G = dL/dZ: [N, k]
//   dY = G W2ᵀ,  dW1 = Xᵀ dY,  dW2 = Yᵀ G.
// Standard BP holds Y and dY for all N rows; the streamed form takes D row blocks one after the other, computes Y_i
// and dY_i, adds X_iᵀ dY_i and Y_iᵀ G_i into the weight gradients and drops them: the intermediates shrink to
// 1/D at the same FLOP count. (The paper's L = sum(Z) makes G all ones, which turns every GEMM with G into a rank-one
// product; a fixed G keeps the four GEMMs real.)
//
// Written twice with the same arithmetic: in Eigen (linear_toy.cpp: no autograd, no torch; the independent
// reference) and in LibTorch (linear_toy_torch.cpp: the same products with at::mm_out, its bytes seen by the CPU
// meter). On integer-valued inputs in {-1, 0, 1} with N·max(m, k) <= 2^24 every product and partial sum is an exact
// fp32 integer, so all four results (standard/streamed × Eigen/LibTorch) must be bitwise equal in any summation
// order: equality there is exactness, not a tolerance.
#pragma once

#include <cstdint>
#include <vector>

namespace sbp {

struct LinearToyInputs {
  std::int64_t rows = 0, m = 0, n = 0, k = 0;  // N and the three widths
  std::vector<float> X, W1, W2, G;               // row-major: [N, m], [m, n], [n, k], [N, k]
  // Entries drawn from {-1, 0, 1} (integer: the exact case above) or N(0, 1), from `seed`.
  static LinearToyInputs make(std::int64_t rows, std::int64_t m, std::int64_t n, std::int64_t k, bool integer,
                              std::uint64_t seed);
  std::int64_t input_bytes() const;  // X, W1, W2, G
};

struct LinearToyResult {
  std::vector<float> dW1, dW2;          // [m, n], [n, k] row-major
  std::int64_t intermediate_bytes = 0;  // the Y/dY blocks alive at once (2 · rows per block · n · 4)
  std::int64_t peak_bytes = 0;          // measured (LibTorch, CPU meter) or counted (Eigen: every matrix it holds)
  double seconds = 0;
};

// partitions = 1 is standard BP (one block of N rows); D > 1 streams ceil(N / D)-row blocks, the last one the
// remainder. drop_remainder (a negative control's fault) skips the remainder block, like a loop over N / D full
// blocks would.
LinearToyResult linear_toy_eigen(const LinearToyInputs& in, std::int64_t partitions, bool drop_remainder = false);
LinearToyResult linear_toy_torch(const LinearToyInputs& in, std::int64_t partitions, bool drop_remainder = false);

// The analytic bytes: inputs + both weight gradients + the intermediates of one block.
std::int64_t linear_toy_block_rows(std::int64_t rows, std::int64_t partitions);
std::int64_t linear_toy_model_bytes(const LinearToyInputs& in, std::int64_t partitions);

}  // namespace sbp
