#include "core/chunk_attention.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

namespace sbp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Blocks of a bf16/fp16 chunk are computed in fp32: each block's output would otherwise be rounded to 16 bits
// before the merge, one rounding more than a single SDPA call makes (measured: 2.5x standard BP's bf16 error on
// a q bias). fp32 and fp64 run as they are.
at::Tensor upcast(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf ? t.to(at::kFloat) : t;
}

struct PrefixAndDiagonal : torch::autograd::Function<PrefixAndDiagonal> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q_in, const at::Tensor& k_in,
                            const at::Tensor& v_in, std::int64_t q_start, double scale) {
    const auto q = upcast(q_in), k = upcast(k_in), v = upcast(v_in);
    const auto c = q.size(2);
    const auto [o_prefix, lse_prefix] = at::_scaled_dot_product_flash_attention_for_cpu(
        q, k.narrow(2, 0, q_start), v.narrow(2, 0, q_start), 0.0, /*is_causal=*/false, {}, scale);
    const auto [o_diag, lse_diag] = at::_scaled_dot_product_flash_attention_for_cpu(
        q, k.narrow(2, q_start, c), v.narrow(2, q_start, c), 0.0, /*is_causal=*/true, {}, scale);
    // Softmax over the union of the two key sets: weights exp(lse_block - lse) (lse: [B, n_h, c], >= fp32).
    const auto lse = at::logaddexp(lse_prefix, lse_diag);
    const auto acc = lse.scalar_type();
    const auto o = (at::exp(lse_prefix - lse).unsqueeze(-1) * o_prefix.to(acc) +
                    at::exp(lse_diag - lse).unsqueeze(-1) * o_diag.to(acc))
                       .to(q_in.scalar_type());
    ctx->save_for_backward({q_in, k_in, v_in, o, lse});
    ctx->saved_data["q_start"] = q_start;
    ctx->saved_data["scale"] = scale;
    return o;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto q = upcast(saved[0]), k = upcast(saved[1]), v = upcast(saved[2]), o = upcast(saved[3]);
    const auto& lse = saved[4];
    const auto dtype = saved[0].scalar_type();
    const auto q_start = ctx->saved_data["q_start"].toInt();
    const auto scale = ctx->saved_data["scale"].toDouble();
    const auto c = q.size(2);
    const auto grad_o = upcast(grads[0]).contiguous();
    // With the merged o and lse, P = exp(S - lse) and rowsum(dO * O) are those of the whole softmax, so each
    // block's flash backward returns its exact part of dQ and the exact dK, dV of its keys.
    const auto [dq_prefix, dk_prefix, dv_prefix] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        grad_o, q, k.narrow(2, 0, q_start), v.narrow(2, 0, q_start), o, lse, 0.0, /*is_causal=*/false, {}, scale);
    const auto [dq_diag, dk_diag, dv_diag] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        grad_o, q, k.narrow(2, q_start, c), v.narrow(2, q_start, c), o, lse, 0.0, /*is_causal=*/true, {}, scale);
    return {(dq_prefix + dq_diag).to(dtype), at::cat({dk_prefix, dk_diag}, 2).to(dtype),
            at::cat({dv_prefix, dv_diag}, 2).to(dtype), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor chunk_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::int64_t q_start,
                           double scale) {
  TORCH_CHECK(q_start > 0 && k.size(2) == q_start + q.size(2), "chunk_attention: keys must be [0, q_start + c)");
  return PrefixAndDiagonal::apply(q, k, v, q_start, scale);
}

}  // namespace sbp
