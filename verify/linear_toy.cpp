// The Eigen half of the linear toy (linear_toy.h): plain GEMMs into preallocated matrices (noalias: no hidden
// temporaries), so the bytes it holds are exactly the matrices below. Eigen's GEMM packing buffers are cache-sized
// and not counted. Eigen runs single-threaded here (no OpenMP, whose runtime would clash with torch's bundled one).
#include "verify/linear_toy.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <stdexcept>

#include <Eigen/Core>
#include "core/io/input_error.h"

namespace sbp {
namespace {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMap = Eigen::Map<const Matrix>;

}  // namespace

LinearToyInputs LinearToyInputs::make(std::int64_t rows, std::int64_t m, std::int64_t n, std::int64_t k, bool integer,
                                      std::uint64_t seed) {
  if (rows < 1 || m < 1 || n < 1 || k < 1) throw InputError("linear toy: every dimension must be >= 1");
  LinearToyInputs in{rows, m, n, k, {}, {}, {}, {}};
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> trit(-1, 1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto fill = [&](std::vector<float>& v, std::int64_t size) {
    v.resize(std::size_t(size));
    for (auto& x : v) x = integer ? float(trit(gen)) : normal(gen);
  };
  fill(in.X, rows * m);
  fill(in.W1, m * n);
  fill(in.W2, n * k);
  fill(in.G, rows * k);
  return in;
}

std::int64_t LinearToyInputs::input_bytes() const {
  return std::int64_t(X.size() + W1.size() + W2.size() + G.size()) * std::int64_t(sizeof(float));
}

std::int64_t linear_toy_block_rows(std::int64_t rows, std::int64_t partitions) {
  if (partitions < 1 || partitions > rows)
    throw InputError("linear toy: partitions must be in [1, rows], got " + std::to_string(partitions));
  return (rows + partitions - 1) / partitions;
}

std::int64_t linear_toy_model_bytes(const LinearToyInputs& in, std::int64_t partitions) {
  const auto c = linear_toy_block_rows(in.rows, partitions);
  return in.input_bytes() + (in.m * in.n + in.n * in.k) * 4 + 2 * c * in.n * 4;
}

LinearToyResult linear_toy_eigen(const LinearToyInputs& in, std::int64_t partitions, bool drop_remainder) {
  const auto c = linear_toy_block_rows(in.rows, partitions);
  const ConstMap X(in.X.data(), in.rows, in.m), W1(in.W1.data(), in.m, in.n), W2(in.W2.data(), in.n, in.k),
      G(in.G.data(), in.rows, in.k);
  const auto start = std::chrono::steady_clock::now();
  Matrix dW1 = Matrix::Zero(in.m, in.n), dW2 = Matrix::Zero(in.n, in.k);
  Matrix Y(c, in.n), dY(c, in.n);  // one block's intermediates (all N rows when partitions = 1)
  for (std::int64_t s = 0; s < in.rows; s += c) {
    const auto rows = std::min(c, in.rows - s);
    if (drop_remainder && rows < c) break;
    auto Yi = Y.topRows(rows);
    auto dYi = dY.topRows(rows);
    Yi.noalias() = X.middleRows(s, rows) * W1;
    dYi.noalias() = G.middleRows(s, rows) * W2.transpose();
    dW1.noalias() += X.middleRows(s, rows).transpose() * dYi;
    dW2.noalias() += Yi.transpose() * G.middleRows(s, rows);
  }
  LinearToyResult out;
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  out.dW1.assign(dW1.data(), dW1.data() + dW1.size());
  out.dW2.assign(dW2.data(), dW2.data() + dW2.size());
  out.intermediate_bytes = std::int64_t(Y.size() + dY.size()) * 4;
  out.peak_bytes = in.input_bytes() + std::int64_t(dW1.size() + dW2.size()) * 4 + out.intermediate_bytes;
  return out;
}

}  // namespace sbp
