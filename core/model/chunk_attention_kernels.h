// The kernels behind chunk_attention (chunk_attention.h), in two kinds:
//  - block kernels (AttentionKernel): a key block at a time, the prefix in full and the diagonal block causal,
//    merged by log-sum-exp in >= fp32. CPU (every dtype) and CUDA fp32.
//  - whole-chunk kernels (WholeChunkKernel): one call over the chunk's whole key range [0, s+c) with the causal rule
//    aligned bottom-right, 16-bit in and out with fp32 accumulation inside: CUDA bf16/fp16, where flash attention's
//    tensor-core kernel is the reason to be on a GPU at all.
// chunk_attention picks one by device and dtype (choose_chunk_attention). Exposed so that tests can drive each
// kernel's handling of K/V, heads and gradients through CPU kernels on a machine without a GPU.
#pragma once

#include <cstdint>
#include <tuple>
#include <utility>

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

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
  // The kernel takes q, k, v and grad_o in their 16-bit dtype (o, lse and its outputs stay >= fp32); otherwise 16-bit
  // operands are upcast to fp32 for it.
  bool narrow_operands = false;
};

// What a whole-chunk forward hands to its backward: the output as the kernel rounded it, its log-sum-exp, and the
// kernel's RNG state (CUDA flash returns one even without dropout and its backward takes it back; undefined on the
// CPU).
struct WholeChunkForward {
  at::Tensor o;    // [B, n_h, c, hd], the query's dtype
  at::Tensor lse;  // [B, n_h, c], fp32 (fp64 from the CPU reference in fp64)
  at::Tensor rng_seed, rng_offset;
};

struct WholeChunkKernel {
  const char* name;
  // q: [B, n_h, c, hd]; k, v: [B, n_kv, s+c, hd] (n_kv divides n_h), all one dtype. Query i (absolute position s+i)
  // attends keys [0, s+i]: the causal rule aligned to the bottom-right corner of the [c, s+c] score matrix.
  WholeChunkForward (*forward)(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale);
  // -> dq [B, n_h, c, hd], dk, dv [B, n_kv, s+c, hd], in the query's dtype: the chunk's whole share of the K/V
  // gradients (GQA group sums done by the kernel).
  std::tuple<at::Tensor, at::Tensor, at::Tensor> (*backward)(const at::Tensor& grad_o, const at::Tensor& q,
                                                             const at::Tensor& k, const at::Tensor& v,
                                                             const WholeChunkForward& saved, double scale);
};

// CPU: the flash kernels of ATen's CPU backend (GQA native). CUDA: the memory-efficient (cutlass) kernels, which
// take fp32 and compute a log-sum-exp for any head count, but need equal heads.
const AttentionKernel& cpu_attention_kernel();
const AttentionKernel& cuda_attention_kernel();
// CPU bf16 (chunk_attention_bf16.cpp): bf16 operands, fp32 accumulation and outputs, oneDNN's native bf16 products;
// GQA native. Only where cpu_bf16_attention_available().
const AttentionKernel& cpu_bf16_attention_kernel();
// oneDNN is built in and has native bf16 kernels on this CPU under ONEDNN_MAX_CPU_ISA, and the CPU has AVX-512.
bool cpu_bf16_attention_available();
// Its backward's scratch in one call over `matrices` (batch rows x K/V heads) of `rows` queries (a K/V head's query
// heads x c) by `keys` keys (`causal`: the diagonal block, keys = c, whose row tiles reach fewer keys and so run
// products of other shapes), at the softmax `scale` of the step (its products are oneDNN primitives of that scale), on
// `threads` intra-op threads: each worker's scores and their gradient in fp32, the probabilities in bf16 over a tile
// of rows, and oneDNN's scratchpad for its products (asked of oneDNN: it depends on the library and the CPU). The
// memory models count it; the other blocks are outputs or copies.
std::int64_t cpu_bf16_attention_backward_scratch_bytes(std::int64_t matrices, std::int64_t rows, std::int64_t keys,
                                                       std::int64_t head_dim, bool causal, double scale,
                                                       std::int64_t threads);

// CUDA bf16/fp16: flash attention 2 (`_scaled_dot_product_flash_attention` and its backward) with is_causal, which
// that kernel aligns bottom-right when c != s+c. GQA native; head_dim a multiple of 8, at most 256; sm80 or newer.
const WholeChunkKernel& cuda_whole_chunk_kernel();
// The readable reference of the same contract on the CPU: ATen's CPU flash kernel with an explicit additive [c, s+c]
// bottom-right mask (O(c (s+c)) memory, which is why no path chooses it). Tests stand it in for the CUDA kernel.
const WholeChunkKernel& cpu_masked_whole_chunk_kernel();

// What chunk_attention runs for a query on `device` in `dtype`: exactly one of the two is set.
struct ChunkAttentionChoice {
  const AttentionKernel* blocks = nullptr;
  const WholeChunkKernel* whole = nullptr;
  const char* name() const { return whole ? whole->name : blocks->name; }
};
// CPU: CPU flash blocks (16-bit K/V upcast to fp32 tile by tile); CUDA fp32/fp64: memory-efficient blocks (fp64 is
// refused by the kernel); CUDA bf16/fp16: the flash whole-chunk kernel.
ChunkAttentionChoice choose_chunk_attention(c10::DeviceType device, c10::ScalarType dtype);

// chunk_attention with an explicit kernel (chunk_attention picks by device and dtype).
at::Tensor chunk_attention_with(const AttentionKernel& kernel, const at::Tensor& q, const at::Tensor& k,
                                const at::Tensor& v, std::int64_t q_start, double scale, const KVGradSums* sums);
at::Tensor chunk_attention_with(const WholeChunkKernel& kernel, const at::Tensor& q, const at::Tensor& k,
                                const at::Tensor& v, std::int64_t q_start, double scale, const KVGradSums* sums);

// Tests only: while alive, choose_chunk_attention gives `kernel` for 16-bit queries on the CPU, so that a whole
// model step on a CPU runs the path CUDA takes in bf16 (through cpu_masked_whole_chunk_kernel). One at a
// time, not thread-safe.
// Tests only: while alive, the CPU bf16 kernel splits a K/V head's query rows into tiles of `rows` (0: its scratch
// budget's own choice), so that small cases take several tiles. One at a time, not thread-safe.
class ScopedBf16AttentionRowTile {
 public:
  explicit ScopedBf16AttentionRowTile(std::int64_t rows);
  ~ScopedBf16AttentionRowTile();
  ScopedBf16AttentionRowTile(const ScopedBf16AttentionRowTile&) = delete;
  ScopedBf16AttentionRowTile& operator=(const ScopedBf16AttentionRowTile&) = delete;

 private:
  std::int64_t previous_;
};

class ScopedCpuWholeChunkKernel {
 public:
  explicit ScopedCpuWholeChunkKernel(const WholeChunkKernel& kernel);
  ~ScopedCpuWholeChunkKernel();
  ScopedCpuWholeChunkKernel(const ScopedCpuWholeChunkKernel&) = delete;
  ScopedCpuWholeChunkKernel& operator=(const ScopedCpuWholeChunkKernel&) = delete;

 private:
  const WholeChunkKernel* previous_;
};

}  // namespace sbp
