// Causal attention of a query chunk at absolute positions [s, s+c) over the key prefix [0, s+c), bottom-right
// aligned, without any mask: the prefix block [0, s) is attended in full, the diagonal block [s, s+c) with SDPA's
// causal rule (square, so top-left and bottom-right coincide), and the two are merged by log-sum-exp. Attention
// work is exactly the causal triangle — no masked-out half of the diagonal block, no [c, e] mask (DESIGN §4).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace sbp {

// q: [B, n_h, c, hd]; k, v: [B, n_kv, s+c, hd] (n_h a multiple of n_kv) -> o: [B, n_h, c, hd]. Differentiable
// in q, k, v: the backward runs the flash backward of each block with the merged output and log-sum-exp, which
// gives each block's exact share of the gradient.
at::Tensor chunk_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::int64_t q_start,
                           double scale);

}  // namespace sbp
