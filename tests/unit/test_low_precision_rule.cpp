// The low-precision rule itself (verify/grad_compare.h, issue #28), on synthetic gradients whose noise is known:
// its quantiles are the F-distribution's, an exact method (noise of standard's scale) passes at every tensor size
// however the draws fall, and a method with several times standard's noise fails once the tensor has the entries to
// tell. The rule's behaviour on real methods is in test_exactness.cpp and test_negative_controls.cpp.
#include <catch2/catch.hpp>

#include <cmath>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "verify/grad_compare.h"

namespace {

// Oracle a ~ N(0, 1) with n entries, and the same tensor plus independent N(0, sigma^2 a^2) noise (relative noise,
// as rounding makes it).
struct Draw {
  sbp::TensorList oracle, noisy;
};
Draw draw(std::int64_t n, double sigma, at::Generator& gen, const sbp::TensorList* oracle = nullptr) {
  Draw d;
  d.oracle = oracle ? *oracle : sbp::TensorList{{"w", at::normal(0.0, 1.0, {n}, gen, at::kDouble)}};
  const auto& a = d.oracle[0].tensor;
  d.noisy = {{"w", a + a * at::normal(0.0, sigma, {n}, gen, at::kDouble)}};
  return d;
}

}  // namespace

TEST_CASE("the rule's noise quantile is the F-distribution's", "[low-precision][rule]") {
  // Tabulated upper quantiles of F(n, n); noise_ratio_quantile is their square root.
  struct Row {
    double n, alpha, f;
  };
  for (const auto& r : {Row{10, 0.05, 2.978}, Row{10, 0.01, 4.849}, Row{10, 0.001, 8.754}, Row{30, 0.01, 2.386},
                        Row{1, 0.05, 161.45}, Row{60, 0.05, 1.534}}) {
    INFO("F(" << r.n << ", " << r.n << ") at " << 1 - r.alpha);
    CHECK(std::pow(sbp::noise_ratio_quantile(r.n, r.alpha), 2) == Approx(r.f).epsilon(2e-3));
  }
  // The allowance narrows with the tensor's effective entries towards the noise scale, never below it.
  sbp::TensorError t;
  double previous = 1e30;
  for (const double n : {4.0, 16.0, 128.0, 1e4, 1e7}) {
    t.effective_entries = n;
    const double allowance = sbp::low_precision_allowance(t, at::kBFloat16);
    INFO("n = " << n << ": allowance " << allowance);
    CHECK(allowance < previous);
    CHECK(allowance > sbp::low_precision_noise_scale(at::kBFloat16));
    previous = allowance;
  }
  t.effective_entries = 16;
  CHECK(sbp::low_precision_allowance(t, at::kBFloat16) == Approx(2.5 * 3.87).epsilon(1e-2));
  CHECK(sbp::low_precision_allowance(t, at::kFloat) == Approx(3 * 3.87).epsilon(1e-2));
}

TEST_CASE("an exact method passes the rule at any tensor size, a noisier one fails where the entries tell",
          "[low-precision][rule][negative-control]") {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  constexpr double kSigma = 1e-3;
  for (const std::int64_t n : {4, 16, 64, 1024, 65536}) {
    double worst_exact = 0, least_faulty = 1e30;
    for (int trial = 0; trial < 200; ++trial) {
      const auto standard = draw(n, kSigma, gen);
      const auto method = draw(n, kSigma, gen, &standard.oracle);
      const auto faulty = draw(n, 10 * kSigma, gen, &standard.oracle);
      const auto s = sbp::compare_gradients(standard.oracle, standard.noisy);
      worst_exact = std::max(worst_exact, sbp::low_precision_rule(s, sbp::compare_gradients(standard.oracle, method.noisy),
                                                                  at::kBFloat16).worst_ratio);
      least_faulty = std::min(least_faulty, sbp::low_precision_rule(s, sbp::compare_gradients(standard.oracle, faulty.noisy),
                                                                    at::kBFloat16).worst_ratio);
    }
    INFO("n = " << n << ": worst exact statistic " << worst_exact << ", least faulty " << least_faulty);
    // 200 draws of the same noise scale stay well inside the allowance (it admits 2x with probability 1e-6 of more).
    CHECK(worst_exact < 0.8);
    // 10x standard's noise: a fault the rule must see on every draw once the tensor has ~10^3 entries (Gaussian
    // entries carry n/3 effective ones); on tens of entries two noise draws cannot be told from a 10x one at a
    // false-failure rate of 1e-6, which is why real faults are judged on every tensor, large ones included.
    if (n >= 1024) CHECK(least_faulty > 1);
  }
}
