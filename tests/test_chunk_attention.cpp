// chunk_attention against one whole-sequence SDPA call, in fp64: the chunk's output and the gradients of q, k, v
// (through autograd and into KVGradSums). Both kernel set-ups run here: the CPU one, and the CUDA one's K/V handling
// (GQA heads expanded per 1024-key tile, gradients summed back per group) driven through the CPU flash kernel, so
// the part of the CUDA path that is not the cutlass kernel itself is tested on a machine without a GPU.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include "core/chunk_attention.h"
#include "core/chunk_attention_kernels.h"

namespace {

using sbp::AttentionKernel;

double relative_error(const at::Tensor& got, const at::Tensor& want) {
  return (got - want).norm().item<double>() / want.norm().item<double>();
}

// What one chunk must reproduce: rows [s, T) of causal attention over [0, T), and the gradients of
// L = sum(o * g) with respect to those query rows and to every key and value row.
struct Case {
  at::Tensor q, k, v, g;  // q: [B, n_h, T, hd]; k, v: [B, n_kv, T, hd]; g: [B, n_h, T - s, hd]
  std::int64_t s;
  double scale;
  at::Tensor o, dq, dk, dv;  // the reference
};

Case make_case(std::int64_t T, std::int64_t s, std::int64_t heads, std::int64_t kv_heads) {
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  at::manual_seed(7);
  Case c;
  c.q = at::randn({2, heads, T, 16}, opts), c.k = at::randn({2, kv_heads, T, 16}, opts);
  c.v = at::randn({2, kv_heads, T, 16}, opts), c.g = at::randn({2, heads, T - s, 16}, opts);
  c.s = s;
  c.scale = 0.25;
  const auto q = c.q.clone().requires_grad_(), k = c.k.clone().requires_grad_(), v = c.v.clone().requires_grad_();
  const auto o = at::scaled_dot_product_attention(q, k, v, {}, 0.0, true, c.scale, kv_heads != heads).narrow(2, s, T - s);
  (o * c.g).sum().backward();
  c.o = o.detach(), c.dq = q.grad().narrow(2, s, T - s), c.dk = k.grad(), c.dv = v.grad();
  return c;
}

struct Result {
  at::Tensor o, dq, dk, dv;
};

Result run_chunk(const AttentionKernel& kernel, const Case& c, bool into_sums) {
  const auto q = c.q.narrow(2, c.s, c.q.size(2) - c.s).clone().requires_grad_();
  const auto k = c.k.clone().requires_grad_(!into_sums), v = c.v.clone().requires_grad_(!into_sums);
  sbp::KVGradSums sums{at::zeros_like(c.k), at::zeros_like(c.v)};
  const auto o = sbp::chunk_attention_with(kernel, q, k, v, c.s, c.scale, into_sums ? &sums : nullptr);
  (o * c.g).sum().backward();
  if (into_sums) return {o.detach(), q.grad(), sums.dK, sums.dV};
  return {o.detach(), q.grad(), k.grad(), v.grad()};
}

AttentionKernel cuda_layout_on_cpu() {
  AttentionKernel kernel = sbp::cpu_attention_kernel();
  kernel.needs_equal_heads = sbp::cuda_attention_kernel().needs_equal_heads;
  kernel.tiles_prefix = sbp::cuda_attention_kernel().tiles_prefix;
  return kernel;
}

double worst_error(const Result& r, const Case& c) {
  return std::max({relative_error(r.o, c.o), relative_error(r.dq, c.dq), relative_error(r.dk, c.dk),
                   relative_error(r.dv, c.dv)});
}

}  // namespace

TEST_CASE("chunk_attention equals whole-sequence attention in fp64, with either kernel layout", "[attention]") {
  const AttentionKernel cuda_like = cuda_layout_on_cpu();
  REQUIRE(cuda_like.needs_equal_heads);  // the CUDA kernel set-up is the one with expanded K/V heads
  // s = 2500: a prefix of three tiles (1024, 1024, 452) under the CUDA layout; GQA (4 query heads on 2) and MHA.
  for (const auto kv_heads : {2, 4}) {
    const Case c = make_case(2600, 2500, 4, kv_heads);
    for (const bool into_sums : {false, true}) {
      INFO("kv_heads " << kv_heads << ", into sums " << into_sums);
      CHECK(worst_error(run_chunk(sbp::cpu_attention_kernel(), c, into_sums), c) < 1e-12);
      CHECK(worst_error(run_chunk(cuda_like, c, into_sums), c) < 1e-12);
    }
  }
}

namespace {
// A known bug for the negative control: the group sum of the expanded K/V gradients keeps only the first head.
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_dropping_heads(const at::Tensor& grad_o, const at::Tensor& q,
                                                                       const at::Tensor& k, const at::Tensor& v,
                                                                       const at::Tensor& o, const at::Tensor& lse,
                                                                       bool causal, double scale) {
  auto [dq, dk, dv] = sbp::cpu_attention_kernel().backward(grad_o, q, k, v, o, lse, causal, scale);
  dk.narrow(1, 1, dk.size(1) - 1).zero_();
  return {dq, dk, dv};
}
}  // namespace

TEST_CASE("negative control: the chunk attention check fails when the expanded K/V gradients lose heads",
          "[attention][negative]") {
  AttentionKernel faulty = cuda_layout_on_cpu();
  faulty.backward = backward_dropping_heads;
  const Case c = make_case(1200, 1100, 4, 2);
  const Result r = run_chunk(faulty, c, true);
  CHECK(relative_error(r.o, c.o) < 1e-12);  // the forward is untouched
  CHECK(relative_error(r.dk, c.dk) > 0.1);
}

TEST_CASE("the CUDA attention kernel refuses fp64 with a clear error", "[attention][cuda]") {
  // Reached before any CUDA call: the dtype check runs first, so it holds on a machine without a GPU.
  const auto q = at::zeros({1, 2, 4, 16}, at::kDouble);
  CHECK_THROWS_WITH(sbp::cuda_attention_kernel().forward(q, q, q, true, 0.25), Catch::Contains("fp64 runs on the CPU"));
}
