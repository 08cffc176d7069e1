// Causal attention of a query chunk at absolute positions [s, s+c) over the key prefix [0, s+c), bottom-right
// aligned, without materialising a mask (ARCHITECTURE.md §4). Two paths, chosen by device and dtype
// (chunk_attention_kernels.h):
//  - blocks (CPU; CUDA fp32): the prefix block [0, s) attended in full, the diagonal block [s, s+c) with SDPA's
//    causal rule (square, so top-left and bottom-right coincide), merged by log-sum-exp in >= fp32 (16-bit K/V
//    upcast tile by tile). Attention work is exactly the causal triangle.
//  - whole chunk (CUDA bf16/fp16): one flash-attention call over [0, s+c) whose causal rule is aligned bottom-right,
//    bf16 in and out with fp32 accumulation inside: the rounding of standard BP's SDPA call (on sm80 its kernel).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace sbp {

// Where a streamed layer's K/V gradients are summed: [B, n_kv, T, hd] each, in the accumulation dtype (fp32 for a
// bf16 model). Given to chunk_attention, the backward adds each key block's gradient into them as the kernel made it
// (fp32 for bf16), instead of handing it back through autograd, which would round every chunk's share to the K/V
// dtype before the sum (measured: StreamBP-bf16's k_norm gradient at 1.05x the 1.5x-standard allowance with 512
// chunks) and would allocate a prefix-sized dK/dV per chunk. CUDA's whole-chunk flash kernel writes dK/dV only in
// bf16, so there each chunk's share is rounded once before the fp32 sum (bounded on the CPU through the path's
// reference kernel: test_exactness [whole-chunk]), and the kernel itself allocates the prefix-sized dK/dV.
struct KVGradSums {
  at::Tensor dK, dV;
};

// q: [B, n_h, c, hd]; k, v: [B, n_kv, s+c, hd] (n_h a multiple of n_kv) -> o: [B, n_h, c, hd]. Differentiable
// in q, and in k, v unless `sums` is given (then their gradients are added into sums->dK/dV[..., :s+c, :]). Blocks:
// the backward runs each block's flash backward with the merged output and log-sum-exp, which gives each block's
// exact share of the gradient (fp32 for bf16). Whole chunk: the kernel's own backward, whose dK/dV of the prefix
// come rounded to the model's dtype. q_start = 0 (the diagonal block alone) only with `sums`; without, SDPA does
// that case.
at::Tensor chunk_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::int64_t q_start,
                           double scale, const KVGradSums* sums = nullptr);

// The same for any q_start, the one dispatch every caller shares: the square block at 0 (without sums) goes to SDPA's
// causal kernel, whose top-left rule then coincides with the bottom-right one; every other chunk to chunk_attention.
at::Tensor prefix_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::int64_t q_start,
                            double scale, const KVGradSums* sums = nullptr);

// Attention over keys that arrive one block at a time (a ring over the ranks, ARCHITECTURE.md §16): the online
// softmax of a chunk's queries, each block merged by log-sum-exp as chunk_attention merges its prefix tiles, with the
// block kernels (CPU every dtype, CUDA fp32; CUDA bf16's whole-chunk kernel is refused).
struct SoftmaxState {
  at::Tensor o;    // [B, n_h, c, hd], >= fp32: the output over the keys merged so far
  at::Tensor lse;  // [B, n_h, c]: their log-sum-exp
};
// Merges the attention of q [B, n_h, c, hd] over k, v [B, n_kv, n, hd] into `state` (empty: the first block). Every key
// is visible, or `causal`: a square block [p, p + c) of the queries' own positions under the causal rule.
void merge_key_block(SoftmaxState& state, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                     double scale);
// What the backward of a chunk's queries needs of the merge over every key they see, per row and head ([B, n_h, c],
// the merge dtype): the log-sum-exp, and D = rowsum(dO * O), flash attention's row term, so that the merged output O
// itself need not be kept (issue #61).
struct BackwardRows {
  at::Tensor lse, rowsum;
};
// D of dO [B, n_h, c, hd] (any dtype, widened) and the merged output O (>= fp32), in O's dtype.
at::Tensor output_rowsum(const at::Tensor& grad_o, const at::Tensor& o);
// One block's share of the backward, given `rows` over every key the queries see (so that the softmax and D are the
// whole one's): adds into dq [B, n_h, c, hd] (>= fp32) and into dk, dv [B, n_kv, n, hd]. Every key is visible, or
// `causal` (a square block). Its own arithmetic in the compute dtype (fp32 for bf16), kPrefixTile keys at a time: the
// block kernels take O, not D. grad_o may be narrower than that dtype (a bf16 dO): it is widened once per call.
void key_block_backward(const at::Tensor& grad_o, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const BackwardRows& rows, bool causal, double scale, at::Tensor& dq, at::Tensor& dk,
                        at::Tensor& dv);

}  // namespace sbp
