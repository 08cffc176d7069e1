// The paper's linear example (appendix A.1, Table 6): streamed over D row blocks it is the same gradient, bitwise, in
// Eigen and in LibTorch, and its intermediates shrink to one block.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>

#include "verify/linear_toy.h"

namespace {

// Integer inputs in {-1, 0, 1}: every product and partial sum is an exact fp32 integer (N·max(m, k) <= 2^24 here),
// so any correct summation order gives the same bits.
const sbp::LinearToyInputs& integer_inputs() {
  static const auto in = sbp::LinearToyInputs::make(/*rows=*/1000, /*m=*/48, /*n=*/40, /*k=*/24, /*integer=*/true, 5);
  return in;
}

}  // namespace

TEST_CASE("the streamed linear toy equals standard BP bitwise, in Eigen and in LibTorch", "[linear-toy][exactness]") {
  const auto& in = integer_inputs();
  const auto standard = sbp::linear_toy_eigen(in, 1);
  // 1000 rows: D = 7 leaves a remainder block (143 x 6 + 142), D = 1000 is one row per block.
  for (const std::int64_t D : {1, 2, 7, 64, 1000}) {
    INFO("D = " << D);
    for (const auto& r : {sbp::linear_toy_eigen(in, D), sbp::linear_toy_torch(in, D)}) {
      CHECK(r.dW1 == standard.dW1);
      CHECK(r.dW2 == standard.dW2);
    }
  }
  // Not trivially zero: the gradients carry the data.
  CHECK(std::any_of(standard.dW1.begin(), standard.dW1.end(), [](float x) { return std::abs(x) > 10; }));
}

TEST_CASE("the linear toy's intermediates are one block: counted in Eigen, measured by the meter in LibTorch",
          "[linear-toy][meter]") {
  const auto& in = integer_inputs();
  for (const std::int64_t D : {1, 7, 100}) {
    INFO("D = " << D);
    const auto block = sbp::linear_toy_block_rows(in.rows, D);
    const auto eigen = sbp::linear_toy_eigen(in, D), torch = sbp::linear_toy_torch(in, D);
    CHECK(eigen.intermediate_bytes == 2 * block * in.n * 4);
    CHECK(torch.intermediate_bytes == eigen.intermediate_bytes);
    CHECK(torch.peak_bytes == eigen.peak_bytes);
    CHECK(eigen.peak_bytes == sbp::linear_toy_model_bytes(in, D));
  }
}

TEST_CASE("the linear toy's equality check fails when the remainder block is dropped", "[linear-toy][negative-control]") {
  const auto& in = integer_inputs();
  const auto standard = sbp::linear_toy_eigen(in, 1);
  CHECK(sbp::linear_toy_eigen(in, 7, /*drop_remainder=*/true).dW1 != standard.dW1);
  CHECK(sbp::linear_toy_torch(in, 7, /*drop_remainder=*/true).dW2 != standard.dW2);
}

TEST_CASE("the linear toy rejects partition counts outside [1, rows]", "[linear-toy]") {
  const auto& in = integer_inputs();
  CHECK_THROWS_WITH(sbp::linear_toy_eigen(in, 0), Catch::Contains("partitions must be in [1, rows]"));
  CHECK_THROWS_WITH(sbp::linear_toy_torch(in, 1001), Catch::Contains("partitions must be in [1, rows]"));
}
