#include "core/chunk_attention.h"

#include <algorithm>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

namespace sbp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Blocks of a bf16/fp16 chunk are computed in fp32: each block's output would otherwise be rounded to 16 bits
// before the merge, one rounding more than a single SDPA call makes (measured: 2.5x standard BP's bf16 error on
// a q bias). The prefix is upcast tile by tile (kPrefixTile keys at a time), never as a whole: a full-prefix fp32
// copy of K and V per chunk was +64% of the bf16 peak on `tiny` at T = 4096 (issue #8). fp32 and fp64 run as they
// are, the prefix in one block.
constexpr std::int64_t kPrefixTile = 1024;

bool upcasts(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf; }
at::Tensor upcast(const at::Tensor& t) { return upcasts(t) ? t.to(at::kFloat) : t; }

// Key blocks [start, start + length) of a chunk with queries at [q_start, q_start + c): the prefix in tiles, then the
// causal diagonal block [q_start, q_start + c).
struct KeyBlock {
  std::int64_t start, length;
  bool causal;
};
std::vector<KeyBlock> key_blocks(std::int64_t q_start, std::int64_t c, bool tiled) {
  std::vector<KeyBlock> blocks;
  const auto tile = tiled ? kPrefixTile : q_start;
  for (std::int64_t s = 0; s < q_start; s += tile) blocks.push_back({s, std::min(tile, q_start - s), false});
  blocks.push_back({q_start, c, true});
  return blocks;
}

struct PrefixAndDiagonal : torch::autograd::Function<PrefixAndDiagonal> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q_in, const at::Tensor& k_in,
                            const at::Tensor& v_in, std::int64_t q_start, double scale, const KVGradSums* sums) {
    const auto q = upcast(q_in);
    at::Tensor o, lse;  // the merge so far: [B, n_h, c, hd] and [B, n_h, c], >= fp32
    for (const auto& b : key_blocks(q_start, q.size(2), upcasts(k_in))) {
      const auto [o_b, lse_b] = at::_scaled_dot_product_flash_attention_for_cpu(
          q, upcast(k_in.narrow(2, b.start, b.length)), upcast(v_in.narrow(2, b.start, b.length)), 0.0, b.causal, {},
          scale);
      if (!o.defined()) {
        o = o_b.to(lse_b.scalar_type());
        lse = lse_b;
        continue;
      }
      // Softmax over the union of the key sets: weights exp(lse_block - lse).
      const auto merged = at::logaddexp(lse, lse_b);
      o = at::exp(lse - merged).unsqueeze(-1) * o + at::exp(lse_b - merged).unsqueeze(-1) * o_b.to(o.scalar_type());
      lse = merged;
    }
    // The backward needs the exact merged output: kept in its (>= fp32) merge dtype, chunk-sized.
    ctx->save_for_backward({q_in, k_in, v_in, o, lse});
    ctx->saved_data["q_start"] = q_start;
    ctx->saved_data["scale"] = scale;
    if (sums) ctx->saved_data["sums"] = at::IValue(std::vector<at::Tensor>{sums->dK, sums->dV});
    return o.to(q_in.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& k_in = saved[1];
    const auto& v_in = saved[2];
    const auto q = upcast(saved[0]), o = saved[3].to(upcast(saved[0]).scalar_type());
    const auto& lse = saved[4];
    const auto q_start = ctx->saved_data["q_start"].toInt();
    const auto scale = ctx->saved_data["scale"].toDouble();
    const auto grad_o = upcast(grads[0]).contiguous();
    // With the merged o and lse, P = exp(S - lse) and rowsum(dO * O) are those of the whole softmax, so each
    // block's flash backward returns its exact part of dQ and the exact dK, dV of its keys: added into the sums, or
    // written into the gradients of K and V (no concatenation).
    const bool to_sums = ctx->saved_data.count("sums") > 0;
    at::Tensor dq, dk, dv;
    if (to_sums) {
      const auto sums = ctx->saved_data["sums"].toTensorVector();
      dk = sums[0], dv = sums[1];
    } else {
      dk = at::empty_like(k_in, at::MemoryFormat::Contiguous), dv = at::empty_like(v_in, at::MemoryFormat::Contiguous);
    }
    for (const auto& b : key_blocks(q_start, q.size(2), upcasts(k_in))) {
      const auto [dq_b, dk_b, dv_b] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
          grad_o, q, upcast(k_in.narrow(2, b.start, b.length)), upcast(v_in.narrow(2, b.start, b.length)), o, lse, 0.0,
          b.causal, {}, scale);
      dq = dq.defined() ? dq.add_(dq_b) : dq_b;
      if (to_sums) {
        dk.narrow(2, b.start, b.length).add_(dk_b);
        dv.narrow(2, b.start, b.length).add_(dv_b);
      } else {
        dk.narrow(2, b.start, b.length).copy_(dk_b);
        dv.narrow(2, b.start, b.length).copy_(dv_b);
      }
    }
    if (to_sums) dk = dv = at::Tensor();
    return {dq.to(saved[0].scalar_type()), dk, dv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor chunk_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::int64_t q_start,
                           double scale, const KVGradSums* sums) {
  TORCH_CHECK((q_start > 0 || sums) && k.size(2) == q_start + q.size(2), "chunk_attention: keys must be [0, q_start + c)");
  TORCH_CHECK(!sums || (!k.requires_grad() && !v.requires_grad()),
              "chunk_attention: K/V gradients go into the sums; k and v must not require grad");
  return PrefixAndDiagonal::apply(q, k, v, q_start, scale, sums);
}

}  // namespace sbp
