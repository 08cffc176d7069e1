// What a kernel allocates beyond its inputs and outputs (ARCHITECTURE.md §7: "models are of the method, not of one machine").
// The analytic memory models name the kernel call that runs at each of their moments; how much scratch that call
// takes is not arithmetic of the method but of the kernel library and the CPU (or GPU) under it, so it is answered
// by a KernelWorkspaces: probes of the same calls measured on the running machine (profiler/calibration.h), or none.
//
// Measured on one AMD EPYC, bf16, 2 threads (tiny's shapes) to show why no constant can stand in for a probe:
//   a [1024, 512] x [512, 64] GEMM takes 263.8 KiB natively (oneDNN's AVX512-BF16 brgemm: packing blocks that stop
//   growing beyond ~1k rows and 4k reductions), 256.1 KiB under ONEDNN_MAX_CPU_ISA=AVX512_CORE (an fp32 copy of the
//   output, 4 bytes per output element at any size) and nothing under AVX2 (ATen's own loop); its transposed-A twin
//   takes 801.8 KiB natively and the same as the others elsewhere.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <c10/core/ScalarType.h>

namespace sbp {

struct KernelCall {
  enum class Op {
    gemm,                // out[m, n] = op(A)[m, k] · op(B)[k, n] in `dtype` (at::mm; autograd's linear backward)
    attention_backward,  // the device's flash-style attention backward of one block (ATen's CPU flash kernel)
  };
  Op op = Op::gemm;
  c10::ScalarType dtype = c10::kFloat;
  std::int64_t threads = 1;  // intra-op threads: CPU kernels keep scratch per thread
  // gemm. a_transposed: A is stored as [k, m] and passed as its transpose (autograd's weight gradient grad^T · x);
  // b_transposed: B is stored as [n, k] (at::linear's x · W^T).
  std::int64_t m = 0, n = 0, k = 0;
  bool a_transposed = false, b_transposed = false;
  // attention_backward: q [batch, heads, queries, head_dim], k/v [batch, kv_heads, keys, head_dim]; causal: the
  // square causal block (queries == keys), else every query sees every key.
  std::int64_t batch = 0, heads = 0, kv_heads = 0, queries = 0, keys = 0, head_dim = 0;
  bool causal = false;

  static KernelCall gemm(c10::ScalarType dtype, std::int64_t threads, std::int64_t m, std::int64_t n, std::int64_t k,
                         bool a_transposed, bool b_transposed);
  static KernelCall attention_backward(c10::ScalarType dtype, std::int64_t threads, std::int64_t batch,
                                       std::int64_t heads, std::int64_t kv_heads, std::int64_t queries,
                                       std::int64_t keys, std::int64_t head_dim, bool causal);
  // "gemm bf16 t2 [1024 x 512] x [512 x 64] (A^T)": the cache key and what the run record lists.
  std::string describe() const;
};

// Workspace bytes of a kernel call. One interface for the calibration of a machine and for "none".
class KernelWorkspaces {
 public:
  virtual ~KernelWorkspaces() = default;
  virtual std::int64_t bytes(const KernelCall& call) const = 0;
  // Where the numbers come from, for the run record and the projections: "measured on the running machine (cpu)", "none".
  virtual std::string source() const = 0;
};

// No workspace at all: the projections of GPU-sized runs, whose kernels (cuBLAS, flash) a CPU cannot measure.
std::shared_ptr<const KernelWorkspaces> no_kernel_workspaces();

}  // namespace sbp
