// Causal attention of a query chunk at absolute positions [s, s+c) over the key prefix [0, s+c), bottom-right
// aligned, without any mask: the prefix block [0, s) is attended in full, the diagonal block [s, s+c) with SDPA's
// causal rule (square, so top-left and bottom-right coincide), and the two are merged by log-sum-exp. Attention
// work is exactly the causal triangle — no masked-out half of the diagonal block, no [c, e] mask (DESIGN §4).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace sbp {

// Where a streamed layer's K/V gradients are summed: [B, n_kv, T, hd] each, in the accumulation dtype (fp32 for a
// bf16 model). Given to chunk_attention, the backward adds each key block's gradient into them as the kernel made it
// (fp32 for bf16), instead of handing it back through autograd, which would round every chunk's share to the K/V
// dtype before the sum (measured: StreamBP-bf16's k_norm gradient at 1.05x the 1.5x-standard allowance with 512
// chunks) and would allocate a prefix-sized dK/dV per chunk.
struct KVGradSums {
  at::Tensor dK, dV;
};

// q: [B, n_h, c, hd]; k, v: [B, n_kv, s+c, hd] (n_h a multiple of n_kv) -> o: [B, n_h, c, hd]. Differentiable
// in q, and in k, v unless `sums` is given (then their gradients go into sums->dK/dV[..., :s+c, :]): the backward
// runs the flash backward of each block with the merged output and log-sum-exp, which gives each block's exact share
// of the gradient. q_start = 0 (the diagonal block alone) only with `sums`; without, SDPA does that case.
at::Tensor chunk_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::int64_t q_start,
                           double scale, const KVGradSums* sums = nullptr);

}  // namespace sbp
