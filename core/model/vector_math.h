// A workaround for MKL's vector math functions (VML) inside LibTorch: a thread's first call can come out coarse.
//
// ATen computes cos, sin, pow, exp, ... of fp32/fp64 CPU tensors with VML, one call per intra-op thread's share of
// the tensor. Measured with torch 2.14.1 (MKL 2024.2) in this harness's binaries on an AVX512 Xeon, 2 threads: in 3
// to 5 of 100 fresh processes, the first cos on an OpenMP worker thread returned that thread's half of the RoPE
// table with errors up to 1.5e-4 (thousands of ulps; the other half, and every later call, exact). The model's
// bits then differed between processes: a resumed training run no longer matched the uninterrupted one (bf16; a
// probe of the first cos was as often wrong in fp32 runs, 2 of 60). The Python wheel did not show it in 200
// processes; the cause inside MKL is not known.
//
// The workaround spends every thread's first call on a throwaway tensor before the model computes anything with
// them (100 of 100 processes exact after it).
#pragma once

namespace sbp {

// Once per process and per intra-op thread count (a larger count brings new threads): every thread makes its first
// fp32 and fp64 VML call on a throwaway tensor. Cheap after the first time (an atomic load); call it before any
// computation whose bits must not depend on the process.
void spend_first_vector_math_calls();

}  // namespace sbp
