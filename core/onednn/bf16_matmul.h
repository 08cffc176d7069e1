// bf16 x bf16 -> fp32 matrix products through the system's oneDNN (Debian's libdnnl), for the CPU's bf16 block
// attention (core/model/chunk_attention_bf16.cpp).
//
// Why a second oneDNN: block attention on bf16 operands needs fp32 outputs (scores, P·V, dQ, dK, dV: rounding them
// to bf16 is a rounding standard BP's attention does not make). torch 2.14.1 has no CPU kernel for that (aten::mm.dtype
// and bmm.dtype are CUDA-only, mkldnn_matmul takes bf16 outputs only), and the oneDNN inside libtorch_cpu exports
// no symbols. oneDNN itself computes it with its native kernels (brg:avx512_core_bf16 on an AVX512-BF16 EPYC: 180-370
// GFLOP/s on 2 threads at attention's shapes, against 85-145 for ATen's fp32 bmm of the widened operands; exact to
// fp32 accumulation order).
//
// This file and its .cpp include no torch header: torch ships oneDNN 3.x headers in its include folder, which would
// shadow the 2.x headers of the library linked here. Pointers and strides only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace sbp::onednn {

// Whether this build has oneDNN and it runs bf16 products natively on this CPU under this process's
// ONEDNN_MAX_CPU_ISA (AVX512_CORE_BF16 or AMX). Elsewhere its bf16 kernels are emulated or reference code, slower than
// fp32 arithmetic on widened operands.
bool bf16_native();
// "oneDNN 2.6.3, avx512_core_bf16" or why there is none: for run records.
std::string describe();

// C = alpha · op(A) · op(B) (+ C when accumulate) on dense row-major matrices: A is stored [m, k] ([k, m] when
// a_transposed), B [k, n] ([n, k] when b_transposed), C [m, n] fp32; A and B are bf16 (raw uint16 bits). Dense
// operands only: oneDNN 2.6's native kernels (brgemm) take no other strides, and its fallback (gemm:jit) fails inside
// a process that has loaded libtorch_cpu, whose copies of shared template code it binds to.
struct MatmulShape {
  std::int64_t m = 0, n = 0, k = 0;
  bool a_transposed = false, b_transposed = false;
  float alpha = 1.0f;
  bool accumulate = false;
};
// The scratch `matmul` needs for `shape`: oneDNN's packing blocks (it depends on the library, the CPU and the shape;
// 0 for some), in the caller's memory so that the caller's allocator (and the harness's meter) sees it. Makes the
// shape's primitive.
std::size_t scratchpad_bytes(const MatmulShape& shape);
// `scratchpad`: at least scratchpad_bytes(shape) bytes, this call's alone while it runs. Throws std::runtime_error
// where oneDNN has no native kernel for the shape or is not built in.
void matmul(const MatmulShape& shape, const std::uint16_t* a, const std::uint16_t* b, float* c, void* scratchpad);

}  // namespace sbp::onednn
