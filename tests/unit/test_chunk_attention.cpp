// chunk_attention against one whole-sequence SDPA call, in fp64: the chunk's output and the gradients of q, k, v
// (through autograd and into KVGradSums). Every kernel set-up runs here: the CPU blocks; the CUDA blocks' K/V
// handling (GQA heads expanded per 1024-key tile, gradients summed back per group) driven through the CPU flash
// kernel; and the whole-chunk path CUDA takes in bf16 (one call over [0, s+c), bottom-right causal, the kernel's
// dK/dV added into the sums) driven through the CPU flash kernel with a bottom-right mask. So everything of the CUDA
// paths but the CUDA kernels themselves is tested on a machine without a GPU.
#include <catch2/catch.hpp>

#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "core/model/chunk_attention.h"
#include "core/model/chunk_attention_kernels.h"

namespace {

using sbp::AttentionKernel;
using sbp::WholeChunkKernel;

double relative_error(const at::Tensor& got, const at::Tensor& want) {
  return (got - want).norm().item<double>() / want.norm().item<double>();
}

// What one chunk must reproduce: rows [s, T) of causal attention over [0, T), and the gradients of
// L = sum(o * g) with respect to those query rows and to every key and value row.
struct AttentionCase {
  at::Tensor q, k, v, g;  // q: [B, n_h, T, hd]; k, v: [B, n_kv, T, hd]; g: [B, n_h, T - s, hd]
  std::int64_t s;
  double scale;
  at::Tensor o, dq, dk, dv;  // the reference
};

AttentionCase make_attention_case(std::int64_t T, std::int64_t s, std::int64_t heads, std::int64_t kv_heads) {
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  at::manual_seed(7);
  AttentionCase c;
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

struct AttentionResult {
  at::Tensor o, dq, dk, dv;
};

template <typename Kernel>
AttentionResult run_chunk(const Kernel& kernel, const AttentionCase& c, bool into_sums) {
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

double worst_error(const AttentionResult& r, const AttentionCase& c) {
  return std::max({relative_error(r.o, c.o), relative_error(r.dq, c.dq), relative_error(r.dk, c.dk),
                   relative_error(r.dv, c.dv)});
}

}  // namespace

TEST_CASE("chunk_attention equals whole-sequence attention in fp64, with either kernel layout", "[attention]") {
  const AttentionKernel cuda_like = cuda_layout_on_cpu();
  REQUIRE(cuda_like.needs_equal_heads);  // the CUDA kernel set-up is the one with expanded K/V heads
  // s = 2500: a prefix of three tiles (1024, 1024, 452) under the CUDA layout; GQA (4 query heads on 2) and MHA.
  for (const auto kv_heads : {2, 4}) {
    const AttentionCase c = make_attention_case(2600, 2500, 4, kv_heads);
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
  const AttentionCase c = make_attention_case(1200, 1100, 4, 2);
  const AttentionResult r = run_chunk(faulty, c, true);
  CHECK(relative_error(r.o, c.o) < 1e-12);  // the forward is untouched
  CHECK(relative_error(r.dk, c.dk) > 0.1);
}

TEST_CASE("the CUDA attention kernel refuses fp64 with a clear error", "[attention][cuda]") {
  // Reached before any CUDA call: the dtype check runs first, so it holds on a machine without a GPU.
  const auto q = at::zeros({1, 2, 4, 16}, at::kDouble);
  CHECK_THROWS_WITH(sbp::cuda_attention_kernel().forward(q, q, q, true, 0.25), Catch::Contains("fp64 runs on the CPU"));
}

namespace {

// StreamBP's use of one layer: chunks [0, 7), [7, 20), [20, T) in turn, each over the K/V prefix up to its end (a view
// of the layer's K/V, as streambp.cpp passes it), every chunk's K/V gradients added into one pair of sums.
AttentionResult run_streamed(const WholeChunkKernel& kernel, const AttentionCase& c) {
  const auto T = c.q.size(2);
  sbp::KVGradSums sums{at::zeros_like(c.k), at::zeros_like(c.v)};
  std::vector<at::Tensor> o, dq;
  for (const auto [start, end] : {std::pair<std::int64_t, std::int64_t>{0, 7}, {7, 20}, {20, T}}) {
    const auto q = c.q.narrow(2, start, end - start).clone().requires_grad_();
    const auto o_chunk = sbp::chunk_attention_with(kernel, q, c.k.narrow(2, 0, end), c.v.narrow(2, 0, end), start,
                                                   c.scale, &sums);
    (o_chunk * c.g.narrow(2, start, end - start)).sum().backward();
    o.push_back(o_chunk.detach());
    dq.push_back(q.grad());
  }
  return {at::cat(o, 2), at::cat(dq, 2), sums.dK, sums.dV};
}

// A known bug for the negative control: SDPA's own causal rule, top-left aligned, on the chunk's non-square
// [c, s+c] scores (what `is_causal` means on the CPU and in SDPA, but not in CUDA's flash kernel).
sbp::WholeChunkForward top_left_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  auto [o, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, /*is_causal=*/true, {}, scale);
  return {o, lse, at::Tensor(), at::Tensor()};
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> top_left_backward(const at::Tensor& grad_o, const at::Tensor& q,
                                                                 const at::Tensor& k, const at::Tensor& v,
                                                                 const sbp::WholeChunkForward& f, double scale) {
  return at::_scaled_dot_product_flash_attention_for_cpu_backward(grad_o.contiguous(), q, k, v, f.o, f.lse, 0.0, true,
                                                                  {}, scale);
}

}  // namespace

TEST_CASE("the whole-chunk path equals whole-sequence attention in fp64, its K/V gradients summed chunk by chunk",
          "[attention][whole-chunk]") {
  // The path CUDA runs in bf16, through its CPU reference (CPU flash with a [c, s+c] bottom-right mask): one call per
  // chunk over the keys [0, s+c), K/V sliced to s+c, GQA heads passed as they are (the kernel sums the groups),
  // dK/dV added into the sums over [0, s+c) only. s = 2500: a prefix longer than the blocks' 1024-key tiles.
  const auto& kernel = sbp::cpu_masked_whole_chunk_kernel();
  for (const auto kv_heads : {2, 4}) {
    const AttentionCase c = make_attention_case(2600, 2500, 4, kv_heads);
    for (const bool into_sums : {false, true}) {
      INFO("kv_heads " << kv_heads << ", into sums " << into_sums);
      CHECK(worst_error(run_chunk(kernel, c, into_sums), c) < 1e-12);
    }
    // Three chunks of one layer, the first one alone on its (square) diagonal: the sums must hold every key's
    // gradient over the whole sequence, and the rows beyond each chunk's prefix must stay untouched by it.
    const AttentionCase whole = make_attention_case(40, 0, 4, kv_heads);
    INFO("kv_heads " << kv_heads << ", three chunks into one pair of sums");
    CHECK(worst_error(run_streamed(kernel, whole), whole) < 1e-12);
  }
}

TEST_CASE("negative control: the whole-chunk check fails with the causal rule aligned top-left",
          "[attention][whole-chunk][negative]") {
  const WholeChunkKernel top_left{"top-left causal", top_left_forward, top_left_backward};
  const AttentionCase c = make_attention_case(120, 100, 4, 2);
  const AttentionResult r = run_chunk(top_left, c, true);
  CHECK(relative_error(r.o, c.o) > 0.1);
  CHECK(relative_error(r.dk, c.dk) > 0.1);
  CHECK(worst_error(run_chunk(sbp::cpu_masked_whole_chunk_kernel(), c, true), c) < 1e-12);  // the same case, right
}

TEST_CASE("chunk attention runs the flash whole-chunk kernel for 16-bit CUDA queries and blocks otherwise",
          "[attention][whole-chunk][cuda]") {
  using c10::DeviceType;
  const auto cuda = DeviceType::CUDA, cpu = DeviceType::CPU;
  // bf16 on the CPU: the bf16 kernel where oneDNN has native bf16 kernels (a property of this CPU and
  // ONEDNN_MAX_CPU_ISA), the fp32 blocks elsewhere; fp16 always the fp32 blocks.
  const auto* cpu_bf16 = sbp::cpu_bf16_attention_available() ? &sbp::cpu_bf16_attention_kernel() : &sbp::cpu_attention_kernel();
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    INFO(c10::toString(dtype));
    CHECK(sbp::choose_chunk_attention(cuda, dtype).whole == &sbp::cuda_whole_chunk_kernel());
    CHECK(sbp::choose_chunk_attention(cpu, dtype).blocks ==
          (dtype == at::kBFloat16 ? cpu_bf16 : &sbp::cpu_attention_kernel()));
  }
  // fp64 goes to the CUDA blocks, whose kernel refuses it with the error of the test below.
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    INFO(c10::toString(dtype));
    CHECK(sbp::choose_chunk_attention(cuda, dtype).blocks == &sbp::cuda_attention_kernel());
    CHECK(sbp::choose_chunk_attention(cpu, dtype).blocks == &sbp::cpu_attention_kernel());
  }
  {
    const sbp::ScopedCpuWholeChunkKernel on_cpu(sbp::cpu_masked_whole_chunk_kernel());
    CHECK(sbp::choose_chunk_attention(cpu, at::kBFloat16).whole == &sbp::cpu_masked_whole_chunk_kernel());
    CHECK(sbp::choose_chunk_attention(cpu, at::kFloat).blocks == &sbp::cpu_attention_kernel());
  }
  CHECK(sbp::choose_chunk_attention(cpu, at::kBFloat16).blocks == cpu_bf16);
  CHECK_THROWS_WITH(sbp::choose_chunk_attention(DeviceType::Meta, at::kFloat), Catch::Contains("no kernel for device"));
}

TEST_CASE("the CUDA whole-chunk kernel refuses what flash attention cannot run with a clear error",
          "[attention][whole-chunk][cuda]") {
  // Reached before any CUDA call: the checks run first, so they hold on a machine without a GPU.
  const auto& flash = sbp::cuda_whole_chunk_kernel();
  const auto fp32 = at::zeros({1, 2, 4, 16}, at::kFloat), fp64 = at::zeros({1, 2, 4, 16}, at::kDouble);
  CHECK_THROWS_WITH(flash.forward(fp32, fp32, fp32, 0.25), Catch::Contains("fp32 runs memory-efficient blocks"));
  CHECK_THROWS_WITH(flash.forward(fp64, fp64, fp64, 0.25), Catch::Contains("fp64 runs on the CPU"));
  const auto odd_head_dim = at::zeros({1, 2, 4, 12}, at::kBFloat16);
  CHECK_THROWS_WITH(flash.forward(odd_head_dim, odd_head_dim, odd_head_dim, 0.25),
                    Catch::Contains("head_dim a multiple of 8"));
}

namespace {

// The bf16 operands of an AttentionCase: its tensors rounded to bf16, and the fp64 reference recomputed on the rounded
// values, so that only the kernel's own arithmetic is judged.
AttentionCase rounded_to_bf16(const AttentionCase& c) {
  const auto round = [](const at::Tensor& t) { return t.to(at::kBFloat16).to(at::kDouble); };
  AttentionCase r = c;
  r.q = round(c.q), r.k = round(c.k), r.v = round(c.v), r.g = round(c.g);
  const auto T = r.q.size(2);
  const auto q = r.q.clone().requires_grad_(), k = r.k.clone().requires_grad_(), v = r.v.clone().requires_grad_();
  const auto o = at::scaled_dot_product_attention(q, k, v, {}, 0.0, true, r.scale, k.size(1) != q.size(1))
                     .narrow(2, r.s, T - r.s);
  (o * r.g).sum().backward();
  r.o = o.detach(), r.dq = q.grad().narrow(2, r.s, T - r.s), r.dk = k.grad(), r.dv = v.grad();
  return r;
}

// chunk_attention_with on bf16 tensors; the results widened to fp64. K/V gradients into fp32 sums or into bf16 K/V.
AttentionResult run_bf16_chunk(const AttentionKernel& kernel, const AttentionCase& c, bool into_sums) {
  const auto bf16 = [](const at::Tensor& t) { return t.to(at::kBFloat16); };
  const auto q = bf16(c.q.narrow(2, c.s, c.q.size(2) - c.s)).requires_grad_();
  const auto k = bf16(c.k).requires_grad_(!into_sums), v = bf16(c.v).requires_grad_(!into_sums);
  sbp::KVGradSums sums{at::zeros_like(c.k, at::kFloat), at::zeros_like(c.v, at::kFloat)};
  const auto o = sbp::chunk_attention_with(kernel, q, k, v, c.s, c.scale, into_sums ? &sums : nullptr);
  (o.to(at::kDouble) * c.g).sum().backward();
  const auto wide = [](const at::Tensor& t) { return t.to(at::kDouble); };
  if (into_sums) return {wide(o.detach()), wide(q.grad()), wide(sums.dK), wide(sums.dV)};
  return {wide(o.detach()), wide(q.grad()), wide(k.grad()), wide(v.grad())};
}

// A known bug for the negative control: the diagonal block computed without its causal rule.
std::pair<at::Tensor, at::Tensor> forward_without_causal_rule(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& v, bool, double scale) {
  return sbp::cpu_bf16_attention_kernel().forward(q, k, v, false, scale);
}

}  // namespace

// The bound: every output and gradient of the bf16 kernel within 2^-7 normwise of the fp64 reference on the same
// bf16 values. Its roundings are the probabilities and the scores' gradient before their products (2^-9 relative
// each) and the final bf16 outputs (2^-9): a few units of 2^-9, whatever the CPU's accumulation order.
TEST_CASE("the CPU bf16 block kernel is within bf16 roundings of fp64 attention, over prefix tiles and row tiles",
          "[attention][bf16]") {
  if (!sbp::cpu_bf16_attention_available()) {
    WARN("skipped: no native bf16 kernels of oneDNN on this CPU (or no oneDNN in this build)");
    return;
  }
  const AttentionKernel& kernel = sbp::cpu_bf16_attention_kernel();
  REQUIRE(kernel.narrow_operands);
  // s = 2500: a prefix of three tiles (1024, 1024, 452) and the diagonal block of 100 queries; GQA and MHA; the
  // rows of a K/V head in one tile and in tiles of 64 rows (the last one short).
  for (const auto kv_heads : {2, 4}) {
    const AttentionCase c = rounded_to_bf16(make_attention_case(2600, 2500, 4, kv_heads));
    for (const std::int64_t row_tile : {0, 64}) {
      const sbp::ScopedBf16AttentionRowTile tile(row_tile);
      for (const bool into_sums : {false, true}) {
        INFO("kv_heads " << kv_heads << ", row tile " << row_tile << ", into sums " << into_sums);
        const AttentionResult r = run_bf16_chunk(kernel, c, into_sums);
        CHECK(relative_error(r.o, c.o) < 0x1p-7);
        CHECK(relative_error(r.dq, c.dq) < 0x1p-7);
        CHECK(relative_error(r.dk, c.dk) < 0x1p-7);
        CHECK(relative_error(r.dv, c.dv) < 0x1p-7);
      }
    }
  }
}

TEST_CASE("negative control: the bf16 kernel check fails with the diagonal block unmasked", "[attention][bf16][negative]") {
  if (!sbp::cpu_bf16_attention_available()) {
    WARN("skipped: no native bf16 kernels of oneDNN on this CPU (or no oneDNN in this build)");
    return;
  }
  AttentionKernel faulty = sbp::cpu_bf16_attention_kernel();
  faulty.forward = forward_without_causal_rule;
  const AttentionCase c = rounded_to_bf16(make_attention_case(1200, 1100, 4, 2));
  CHECK(relative_error(run_bf16_chunk(sbp::cpu_bf16_attention_kernel(), c, true).o, c.o) < 0x1p-7);
  CHECK(relative_error(run_bf16_chunk(faulty, c, true).o, c.o) > 0x1p-4);
}
