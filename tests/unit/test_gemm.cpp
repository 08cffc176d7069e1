// The narrow-dtype GEMM paths (core/model/gemm.h, issue #28): the widened path is fp32 arithmetic on the widened
// operands rounded once, in the forward and in every backward product, and the paths can be pinned.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>

#include "core/model/gemm.h"

namespace {

// Restores the process's paths of `dtype` when a test that pinned others ends.
struct PathsRestored {
  c10::ScalarType dtype;
  std::string before = sbp::gemm_paths(dtype).describe();
  ~PathsRestored() { sbp::pin_gemm_paths(dtype, before, "test teardown"); }
};

}  // namespace

TEST_CASE("a widened bf16 linear is fp32 arithmetic rounded once, forward and backward", "[gemm][bf16]") {
  const PathsRestored restore{at::kBFloat16};
  sbp::pin_gemm_paths(at::kBFloat16, "nt=widened,nn=widened,tn=widened", "test");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
  const auto x = at::normal(0.0, 1.0, {2, 37, 48}, gen).to(at::kBFloat16).requires_grad_(true);  // [B, c, k]
  const auto w = at::normal(0.0, 0.1, {80, 48}, gen).to(at::kBFloat16).requires_grad_(true);     // [n, k]
  const auto b = at::normal(0.0, 0.1, {80}, gen).to(at::kBFloat16).requires_grad_(true);
  const auto g = at::normal(0.0, 1.0, {2, 37, 80}, gen).to(bf16.dtype());
  const auto y = sbp::linear(x, w, b);
  const auto grads = torch::autograd::grad({y}, {x, w, b}, {g});

  const auto x32 = x.detach().to(at::kFloat).reshape({-1, 48}), w32 = w.detach().to(at::kFloat);
  const auto g32 = g.to(at::kFloat).reshape({-1, 80});
  CHECK(at::equal(y, at::addmm(b.detach().to(at::kFloat), x32, w32.t()).to(at::kBFloat16).view({2, 37, 80})));
  CHECK(at::equal(grads[0], at::mm(g32, w32).to(at::kBFloat16).view({2, 37, 48})));
  CHECK(at::equal(grads[1], at::mm(x32.t(), g32).to(at::kBFloat16).t()));
  CHECK(at::equal(grads[2], g.reshape({-1, 80}).sum(0)));
  // A frozen weight (LoRA's base) gets no gradient and the input's still flows; no bias is fine.
  const auto frozen = w.detach();
  const auto dx = torch::autograd::grad({sbp::linear(x, frozen)}, {x}, {g})[0];
  CHECK(at::equal(dx, at::mm(g32, w32).to(at::kBFloat16).view({2, 37, 48})));
}

TEST_CASE("the GEMM paths are pinned by a description, and fp32 is never widened", "[gemm]") {
  const PathsRestored restore{at::kBFloat16};
  sbp::pin_gemm_paths(at::kBFloat16, "nt=native,nn=widened,tn=native", "test");
  CHECK(sbp::gemm_paths(at::kBFloat16).describe() == "nt=native,nn=widened,tn=native");
  CHECK(sbp::gemm_paths_reason(at::kBFloat16) == "pinned by test");
  CHECK(sbp::chosen_gemm_paths().at("bf16").first == "nt=native,nn=widened,tn=native");
  CHECK_FALSE(sbp::gemm_paths(at::kFloat).any_widened());
  CHECK(sbp::gemm_paths_reason(at::kFloat).empty());
  CHECK_THROWS_WITH(sbp::pin_gemm_paths(at::kBFloat16, "nt=native,nn=fast,tn=native", "trainer.json"),
                    Catch::Contains("trainer.json: GEMM path 'fast'"));
  CHECK_THROWS_WITH(sbp::pin_gemm_paths(at::kBFloat16, "nt=native", "trainer.json"),
                    Catch::Contains("expected nt, nn and tn"));
}

TEST_CASE("the default GEMM path follows the CPU's flags and oneDNN's cap, never a timing", "[gemm]") {
  using sbp::GemmPath;
  const std::string avx2 = "fpu sse sse2 avx avx2 fma";
  const std::string avx512 = avx2 + " avx512f avx512bw avx512vl";
  const std::string avx512_bf16 = avx512 + " avx512_bf16";
  const std::string amx = avx512_bf16 + " amx_bf16 amx_tile amx_int8";
  CHECK(sbp::default_narrow_gemm_path(avx2, "").first == GemmPath::widened);
  CHECK(sbp::default_narrow_gemm_path(avx512, "").first == GemmPath::widened);
  // AVX512-BF16 without AMX: native is the slower path (qwen3-small bf16 step 22.5 s native, 19.6 s widened).
  const auto no_amx = sbp::default_narrow_gemm_path(avx512_bf16, "");
  CHECK(no_amx.first == GemmPath::widened);
  CHECK_THAT(no_amx.second, Catch::Contains("without AMX"));
  // ... unless oneDNN is capped below its bf16 instructions: then the cap is the reason.
  const auto no_amx_capped = sbp::default_narrow_gemm_path(avx512_bf16, "AVX2");
  CHECK(no_amx_capped.first == GemmPath::widened);
  CHECK_THAT(no_amx_capped.second, Catch::Contains("ONEDNN_MAX_CPU_ISA=AVX2 keeps oneDNN off"));
  CHECK(sbp::default_narrow_gemm_path(amx, "").first == GemmPath::native);
  CHECK(sbp::default_narrow_gemm_path(amx, "ALL").first == GemmPath::native);
  CHECK(sbp::default_narrow_gemm_path(amx, "avx10_1_512_amx").first == GemmPath::native);
  const auto capped = sbp::default_narrow_gemm_path(amx, "avx512_core_bf16");
  CHECK(capped.first == GemmPath::widened);
  CHECK_THAT(capped.second, Catch::Contains("ONEDNN_MAX_CPU_ISA=avx512_core_bf16"));
  CHECK(sbp::default_narrow_gemm_path(amx, "AVX2").first == GemmPath::widened);
  // A flag that only contains the name is not the flag.
  CHECK(sbp::default_narrow_gemm_path(avx2 + " xavx512_bf16 amx_bf16x amx_tilex", "").first == GemmPath::widened);
}

TEST_CASE("a lowered ATen capability on an AMX CPU caps oneDNN below AMX, and nothing else changes the knobs", "[gemm]") {
  const std::string avx512_bf16 = "fpu sse sse2 avx avx2 fma avx512f avx512bw avx512vl avx512_bf16";
  const std::string amx = avx512_bf16 + " amx_bf16 amx_tile amx_int8";
  // torch 2.14.1's bf16 flash attention throws (pack_vnni2) on this pairing; no real CPU has it.
  CHECK(sbp::onednn_cap_for(amx, "default", "") == "AVX512_CORE_BF16");
  CHECK(sbp::onednn_cap_for(amx, "AVX2", "") == "AVX512_CORE_BF16");
  CHECK(sbp::onednn_cap_for(amx, "avx512", "").empty());
  CHECK(sbp::onednn_cap_for(amx, "", "").empty());
  CHECK(sbp::onednn_cap_for(amx, "default", "AVX2").empty());  // the user's own cap stands
  CHECK(sbp::onednn_cap_for(avx512_bf16, "default", "").empty());
  // The cap it sets keeps the bf16 GEMMs off AMX: the widened path, as on a CPU without AVX-512.
  CHECK(sbp::default_narrow_gemm_path(amx, sbp::onednn_cap_for(amx, "avx2", "")).first == sbp::GemmPath::widened);
}
