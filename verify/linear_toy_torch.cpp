// The LibTorch twin of the linear toy (linear_toy.h): the same four products per block, with at::mm_out/addmm_ into
// preallocated tensors, so that what the CPU meter sees is the gradients and one block's Y/dY.
#include <algorithm>
#include <chrono>

#include <ATen/ATen.h>

#include "profiler/cpu_meter.h"
#include "verify/linear_toy.h"

namespace sbp {

LinearToyResult linear_toy_torch(const LinearToyInputs& in, std::int64_t partitions, bool drop_remainder) {
  const auto c = linear_toy_block_rows(in.rows, partitions);
  auto tensor = [](const std::vector<float>& v, std::int64_t r, std::int64_t cols) {
    return at::from_blob(const_cast<float*>(v.data()), {r, cols}, at::kFloat);  // the caller's buffers, no copy
  };
  const auto X = tensor(in.X, in.rows, in.m), W1 = tensor(in.W1, in.m, in.n), W2 = tensor(in.W2, in.n, in.k),
             G = tensor(in.G, in.rows, in.k);
  auto& meter = CpuMemoryMeter::install();
  meter.reset_peak();
  const auto before = meter.current_bytes();
  const auto start = std::chrono::steady_clock::now();
  auto dW1 = at::zeros({in.m, in.n}, at::kFloat), dW2 = at::zeros({in.n, in.k}, at::kFloat);
  auto Y = at::empty({c, in.n}, at::kFloat), dY = at::empty({c, in.n}, at::kFloat);
  for (std::int64_t s = 0; s < in.rows; s += c) {
    const auto rows = std::min(c, in.rows - s);
    if (drop_remainder && rows < c) break;
    auto Yi = Y.narrow(0, 0, rows), dYi = dY.narrow(0, 0, rows);
    const auto Xi = X.narrow(0, s, rows), Gi = G.narrow(0, s, rows);
    at::mm_out(Yi, Xi, W1);
    at::mm_out(dYi, Gi, W2.t());
    dW1.addmm_(Xi.t(), dYi);
    dW2.addmm_(Yi.t(), Gi);
  }
  LinearToyResult out;
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto step_peak = meter.peak_bytes() - before;
  out.peak_bytes = in.input_bytes() + step_peak;
  out.intermediate_bytes = step_peak - (dW1.numel() + dW2.numel()) * 4;
  const auto w1 = dW1.contiguous(), w2 = dW2.contiguous();
  out.dW1.assign(w1.data_ptr<float>(), w1.data_ptr<float>() + w1.numel());
  out.dW2.assign(w2.data_ptr<float>(), w2.data_ptr<float>() + w2.numel());
  return out;
}

}  // namespace sbp
