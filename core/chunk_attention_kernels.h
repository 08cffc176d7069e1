// The block kernels behind chunk_attention (chunk_attention.h): one per device, chosen by the query's device. Exposed
// so that tests can run the CUDA kernel's K/V handling (heads expanded per tile, gradients summed back per group)
// through the CPU kernel on a machine without a GPU.
#pragma once

#include <cstdint>
#include <tuple>
#include <utility>

#include <ATen/core/Tensor.h>

namespace sbp {

struct KVGradSums;

struct AttentionKernel {
  const char* name;
  // The kernel needs as many K/V heads as query heads: each K/V tile is expanded (copied) to n_h heads before the
  // call and its gradients summed back over the group of query heads that shared it.
  bool needs_equal_heads;
  // The prefix is always split into kPrefixTile-key tiles (bounds the expanded copies); otherwise only when K/V are
  // upcast from 16 bits.
  bool tiles_prefix;
  // q: [B, H, c, hd], k, v: [B, H or n_kv, n, hd], all the same floating dtype (>= fp32) -> o [B, H, c, hd] in
  // that dtype, lse [B, H, c] (fp32, or fp64 for fp64). `causal`: square block, causal rule.
  std::pair<at::Tensor, at::Tensor> (*forward)(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               bool causal, double scale);
  // The block's share of dq and its exact dk, dv, given the *merged* o and lse of the whole key set.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> (*backward)(const at::Tensor& grad_o, const at::Tensor& q,
                                                             const at::Tensor& k, const at::Tensor& v,
                                                             const at::Tensor& o, const at::Tensor& lse, bool causal,
                                                             double scale);
};

// CPU: the flash kernels of ATen's CPU backend (GQA native). CUDA: the memory-efficient (cutlass) kernels, which
// take fp32 and compute a log-sum-exp for any head count, but need equal heads.
const AttentionKernel& cpu_attention_kernel();
const AttentionKernel& cuda_attention_kernel();

// chunk_attention with an explicit kernel (chunk_attention picks by device).
at::Tensor chunk_attention_with(const AttentionKernel& kernel, const at::Tensor& q, const at::Tensor& k,
                                const at::Tensor& v, std::int64_t q_start, double scale, const KVGradSums* sums);

}  // namespace sbp
