// The whole-chunk path of chunk_attention (chunk_attention_kernels.h): one kernel call per chunk over the keys
// [0, s+c), causal aligned bottom-right, in the model's 16-bit dtype. This is what standard BP's own SDPA call does
// on a GPU (bf16 in and out, fp32 accumulation inside, one rounding of the output), so StreamBP's attention runs on
// the same bf16 tensor cores instead of the fp32 blocks of the merge path (H100: dense bf16 ~15x its fp32 rate).
#include "core/model/chunk_attention.h"
#include "core/model/chunk_attention_kernels.h"

#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

namespace sbp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct WholeChunk : torch::autograd::Function<WholeChunk> {
  // q: [B, n_h, c, hd]; k, v: [B, n_kv, s+c, hd] -> o: [B, n_h, c, hd], all in the model's dtype.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale, const KVGradSums* sums, const WholeChunkKernel* kernel) {
    auto f = kernel->forward(q, k, v, scale);
    // The backward needs the output as the kernel rounded it (as SDPA's autograd keeps it): a chunk-sized 16-bit
    // tensor, the model's own attention output, plus the [B, n_h, c] fp32 log-sum-exp. k and v are views of the
    // layer's K/V, not copies.
    ctx->save_for_backward({q, k, v, f.o, f.lse, f.rng_seed, f.rng_offset});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["kernel"] = reinterpret_cast<std::int64_t>(kernel);
    if (sums) ctx->saved_data["sums"] = at::IValue(std::vector<at::Tensor>{sums->dK, sums->dV});
    return f.o;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& q = saved[0];
    const auto& k = saved[1];
    const auto& v = saved[2];
    const WholeChunkForward f{saved[3], saved[4], saved[5], saved[6]};
    const auto* kernel = reinterpret_cast<const WholeChunkKernel*>(ctx->saved_data["kernel"].toInt());
    auto [dq, dk, dv] = kernel->backward(grads[0], q, k, v, f, ctx->saved_data["scale"].toDouble());
    if (ctx->saved_data.count("sums") > 0) {
      // The kernel's dK/dV are this chunk's whole share over the keys [0, s+c), rounded once to the model's dtype
      // by the kernel (neither flash nor the memory-efficient kernel can write fp32 gradients): one rounding per
      // chunk before the fp32 sum, which the fp32 blocks of the merge path do not make.
      const auto sums = ctx->saved_data["sums"].toTensorVector();
      sums[0].narrow(2, 0, k.size(2)).add_(dk);
      sums[1].narrow(2, 0, v.size(2)).add_(dv);
      dk = dv = at::Tensor();
    }
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

void check_cuda_whole_chunk_inputs(const at::Tensor& q) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "chunk attention's whole-chunk flash kernel takes bf16/fp16 (fp32 runs memory-efficient blocks on "
              "CUDA, fp64 runs on the CPU: --device cpu); got ", c10::toString(q.scalar_type()));
  TORCH_CHECK(q.size(-1) % 8 == 0 && q.size(-1) <= 256, "chunk attention on CUDA in bf16/fp16 runs flash attention, "
              "which needs head_dim a multiple of 8 and at most 256; head_dim ", q.size(-1), " is not (--dtype fp32 "
              "runs the memory-efficient kernel)");
}

WholeChunkForward cuda_flash_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  check_cuda_whole_chunk_inputs(q);
  // is_causal = true with c queries over s+c keys is the chunk's bottom-right rule in flash attention 2: its mask
  // (flash_attn/mask.h) lets query row i see key columns j < i + 1 + seqlen_k - seqlen_q. SDPA never sends a
  // non-square is_causal call to flash for that reason (sdp_utils.cpp, check_flash_causal_non_square_seqlens: its
  // own rule is top-left); torch.nn.attention.bias.causal_lower_right calls this very op with is_causal=True to get
  // the bottom-right rule. GQA: n_kv may divide n_h (flash_api.cpp mha_fwd), so K/V are passed as they are.
  auto [o, lse, cum_q, cum_k, max_q, max_k, rng_seed, rng_offset, debug_mask] =
      at::_scaled_dot_product_flash_attention(q, k, v, /*dropout_p=*/0.0, /*is_causal=*/true,
                                              /*return_debug_mask=*/false, scale);
  return {o, lse, rng_seed, rng_offset};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cuda_flash_backward(const at::Tensor& grad_o, const at::Tensor& q,
                                                                   const at::Tensor& k, const at::Tensor& v,
                                                                   const WholeChunkForward& f, double scale) {
  // Dense batch: no cumulative sequence lengths. The GQA group sums of dK/dV happen inside (mha_bwd sums an
  // expanded [B, s+c, n_h, hd] gradient into the n_kv heads, in the model's dtype).
  return at::_scaled_dot_product_flash_attention_backward(grad_o, q, k, v, f.o, f.lse, /*cum_seq_q=*/at::Tensor(),
                                                          /*cum_seq_k=*/at::Tensor(), q.size(2), k.size(2),
                                                          /*dropout_p=*/0.0, /*is_causal=*/true, f.rng_seed,
                                                          f.rng_offset, scale);
}

// [c, s+c] additive mask in q's dtype (the CPU kernel takes no bool mask): 0 where query i may see key j <= s+i,
// -inf elsewhere.
at::Tensor bottom_right_mask(const at::Tensor& q, std::int64_t keys) {
  const auto c = q.size(2);
  const auto allowed = at::ones({c, keys}, q.options().dtype(at::kBool)).tril(keys - c);
  return at::zeros({c, keys}, q.options()).masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
}

WholeChunkForward cpu_masked_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  auto [o, lse] =
      at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, false, bottom_right_mask(q, k.size(2)), scale);
  return {o, lse, at::Tensor(), at::Tensor()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_masked_backward(const at::Tensor& grad_o, const at::Tensor& q,
                                                                   const at::Tensor& k, const at::Tensor& v,
                                                                   const WholeChunkForward& f, double scale) {
  return at::_scaled_dot_product_flash_attention_for_cpu_backward(grad_o.contiguous(), q, k, v, f.o, f.lse, 0.0, false,
                                                                  bottom_right_mask(q, k.size(2)), scale);
}

}  // namespace

const WholeChunkKernel& cuda_whole_chunk_kernel() {
  static const WholeChunkKernel kernel{"cuda flash, one call per chunk (bottom-right causal)", cuda_flash_forward,
                                       cuda_flash_backward};
  return kernel;
}

const WholeChunkKernel& cpu_masked_whole_chunk_kernel() {
  static const WholeChunkKernel kernel{"cpu flash with a bottom-right mask, one call per chunk", cpu_masked_forward,
                                       cpu_masked_backward};
  return kernel;
}

at::Tensor chunk_attention_with(const WholeChunkKernel& kernel, const at::Tensor& q, const at::Tensor& k,
                                const at::Tensor& v, std::int64_t q_start, double scale, const KVGradSums* sums) {
  TORCH_CHECK((q_start > 0 || sums) && k.size(2) == q_start + q.size(2) && v.size(2) == k.size(2),
              "chunk_attention: keys must be [0, q_start + c)");
  TORCH_CHECK(!sums || (!k.requires_grad() && !v.requires_grad()),
              "chunk_attention: K/V gradients go into the sums; k and v must not require grad");
  return WholeChunk::apply(q, k, v, scale, sums, &kernel);
}

}  // namespace sbp
