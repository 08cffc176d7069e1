// The running machine's kernel workspaces (core/methods/kernel_workspace.h), measured: each call a memory model names is run
// once, on small inputs of its shape class, under the device's meter, and the bytes it took beyond its inputs and
// outputs are cached for the process. So a model follows whichever kernels the CPU (or GPU) and its libraries pick:
// oneDNN's native bf16 GEMMs, their AVX512_CORE emulation, ATen's fallback loops, or cuBLAS.
//
// Probe shapes (why they stand for the call):
// - GEMM: the exact call when it costs at most kProbeMultiplyAdds. Larger calls keep their output shape and shorten
//   the reduction first (blocked kernels size their buffers by block, not by k; an emulated bf16 GEMM's fp32 buffer
//   is the output's size), then halve the output's longer side, probe twice and extrapolate linearly in output
//   elements (exact for an output-sized buffer, flat for blocked buffers that have stopped growing).
// - Attention backward: batch x K/V heads reduced to what the threads can run at once (the scratch is per thread), the
//   queries to at most 768 and the keys to at most 1024 (ATen's CPU kernels block queries by 256/64/32 from 768/192
//   queries on and keys by 512: every block keeps the shape it has in the full call).
// Probes allocate and reset the meter's peak: never evaluate a memory model inside a measured step.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <c10/core/Device.h>
#include <nlohmann/json.hpp>

#include "core/methods/kernel_workspace.h"

namespace sbp {

// Multiply-adds one GEMM probe may cost (2^31: ~10 ms of a native bf16 GEMM on 2 cores, ~0.1 s emulated).
constexpr std::int64_t kProbeMultiplyAdds = std::int64_t(1) << 31;

// The process-wide calibration of `device` (one per device, probes cached).
std::shared_ptr<const KernelWorkspaces> machine_workspaces(c10::Device device);

// The run record's "calibration": the source, the CPU's instruction sets (lscpu's flags that decide the kernels, the
// ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY limits and the capability ATen dispatches to) and every probe run so far
// in this process (the call, the shape probed, bytes, whether extrapolated, seconds).
nlohmann::json calibration_json(const KernelWorkspaces& workspaces);
// The path each narrow-dtype product of this process took (core/model/gemm.h): {"bf16": {"paths", "reason"}}.
nlohmann::json narrow_gemm_json();

// "avx2 avx512f avx512_bf16 (ATen AVX512; ONEDNN_MAX_CPU_ISA=AVX512_CORE)": the flags above in one line, for
// provenance and CI logs.
std::string cpu_isa_summary();

}  // namespace sbp
