// The probe of gemm_store.h: how fast each layout's narrow product is on the native and on the widened path here.
#include <algorithm>
#include <chrono>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "core/model/gemm_store.h"

namespace sbp {

namespace {

// One shape for every model: the choice is the machine's, shared by every process whatever it runs. qwen3-small's
// MLP products (d = 512, ffn = 1536) over 2048 rows (a StreamBP chunk's order of size): 3.2 GFLOP a product, about
// 30 ms in bf16 on 2 cores of an AVX512-BF16 EPYC, so the 36 timed products of an attempt take about 2 s.
constexpr std::int64_t kRows = 2048, kIn = 512, kOut = 1536;
constexpr int kRepeats = 5, kAttempts = 3;
// Repeats whose median is this much above their minimum were disturbed by another process: measure again.
constexpr double kLoadedSpread = 1.25;

double seconds_of(const std::function<void()>& product) {
  const auto start = std::chrono::steady_clock::now();
  product();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

GemmMeasurement time_gemm_paths(c10::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype);
  const auto x = at::randn({kRows, kIn}).to(options);   // [rows, d]
  const auto w = at::randn({kOut, kIn}).to(options);    // [n, d]
  const auto g = at::randn({kRows, kOut}).to(options);  // [rows, n]
  const auto f32 = at::kFloat;
  // The products gemm.cpp runs on each path, with the operands' layouts of the model (transposes are views).
  const std::array<std::function<at::Tensor()>, 3> native = {
      [&] { return at::mm(x, w.t()); }, [&] { return at::mm(g, w); }, [&] { return at::mm(x.t(), g); }};
  const std::array<std::function<at::Tensor()>, 3> widened = {
      [&] { return at::mm(x.to(f32), w.to(f32).t()).to(dtype); },
      [&] { return at::mm(g.to(f32), w.to(f32)).to(dtype); },
      [&] { return at::mm(x.to(f32).t(), g.to(f32)).to(dtype); }};
  GemmMeasurement m;
  m.shapes = fmt::format("x [{r}, {d}] . w [{n}, {d}]^T, g [{r}, {n}] . w, x^T . g; {k} repeats each, minimum",
                         fmt::arg("r", kRows), fmt::arg("d", kIn), fmt::arg("n", kOut), fmt::arg("k", kRepeats));
  for (auto& s : m.layouts) s = {1e300, 1e300};
  for (m.attempts = 1;; ++m.attempts) {
    bool loaded = false;
    for (std::size_t l = 0; l < 3; ++l) {
      native[l]();  // first touches: oneDNN's kernel generation, the allocator's blocks
      widened[l]();
      std::vector<double> n, w;
      for (int r = 0; r < kRepeats; ++r) {  // interleaved: a disturbance hits both paths alike
        n.push_back(seconds_of([&] { native[l](); }));
        w.push_back(seconds_of([&] { widened[l](); }));
      }
      // The minimum over every attempt: load only ever adds time.
      m.layouts[l].native = std::min(m.layouts[l].native, *std::min_element(n.begin(), n.end()));
      m.layouts[l].widened = std::min(m.layouts[l].widened, *std::min_element(w.begin(), w.end()));
      loaded = loaded || median(n) > kLoadedSpread * *std::min_element(n.begin(), n.end()) ||
               median(w) > kLoadedSpread * *std::min_element(w.begin(), w.end());
    }
    if (!loaded || m.attempts == kAttempts) break;
  }
  return m;
}

}  // namespace sbp
