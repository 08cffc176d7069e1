// Matrix products of a narrow float dtype (bf16, fp16), on the path that is fast on the running machine (issue #28).
//
// A CPU without native bf16 GEMM kernels runs ATen's bf16 products as a scalar loop: on an AVX2-only EPYC the input
// gradient [4096, 1536] x [1536, 512] took 8.15 s against 0.052 s in fp32, and a bf16 training step of qwen3-small at
// T = 4096 did not finish in 13 minutes where fp32 takes 31 s. oneDNN's emulated kernels (AVX512_CORE) are 4-7x
// slower than fp32, and even native AVX512-BF16 kernels are slower than fp32 for some operand layouts. The other path
// is fp32 arithmetic on widened operands with the product rounded once into the narrow dtype: the arithmetic of a bf16
// GEMM with fp32 accumulation, which is what the native kernels compute too (results differ by accumulation order,
// i.e. rounding noise, judged by the low-precision rule like any other reordering).
//
// The path is a property of the machine and the process's environment, never of a timing in the process: a path
// changes the bits of every product, and a choice timed per process flipped between two processes of one machine
// under load (the resumed run of a bitwise-resume test took the other path; ranks of one data-parallel group could
// too). Where the CPU has no native kernels for the dtype (AVX2, AVX512_CORE, or ONEDNN_MAX_CPU_ISA below
// AVX512_CORE_BF16) every layout is widened. Elsewhere each layout's path comes from a measurement made once per
// machine and stored in the cache folder (gemm_store.h, issue #49): a fixed rule (native only with AMX) fitted to one
// Intel Xeon cost an AVX512-BF16 EPYC 1.8x (qwen3-small bf16 StreamBP step at T = 4096, 2 threads: 27.2 s widened,
// 15.5 s native). STREAMBP_NARROW_GEMM=native|widened pins every layout instead. STREAMBP_GEMM_PROBE=off takes the
// stored measurement but never measures (tests, CI), falling back to the flag rule (native only with AMX) when none is
// stored. A resumed training run pins the paths its checkpoint recorded (a checkpoint may move between machines).
// fp32/fp64 and tensors on a GPU are never widened. The layouts keep their own paths so that a checkpoint or a test
// can pin them one by one.
#pragma once

#include <map>
#include <utility>
#include <string>

#include <ATen/core/Tensor.h>
#include "core/io/input_error.h"

namespace sbp {

enum class GemmLayout { nt, nn, tn };  // x·Wᵀ (forward), g·W (input gradient), gᵀ·x (weight gradient)
enum class GemmPath { native, widened };

struct GemmPaths {
  GemmPath nt = GemmPath::native, nn = GemmPath::native, tn = GemmPath::native;
  GemmPath of(GemmLayout layout) const;
  std::string describe() const;  // "nt=native,nn=widened,tn=widened"
  bool any_widened() const { return nt == GemmPath::widened || nn == GemmPath::widened || tn == GemmPath::widened; }
};

// The paths of `dtype` in this process (all native for fp32/fp64), chosen on first use unless pinned.
const GemmPaths& gemm_paths(c10::ScalarType dtype);
// The path of every layout without a measurement, from the CPU's flags (/proc/cpuinfo's "flags" line) and
// ONEDNN_MAX_CPU_ISA's value ("" when unset), with the reason in words: native only on AMX-BF16 tile units.
std::pair<GemmPath, std::string> default_narrow_gemm_path(const std::string& flags, const std::string& onednn_max_isa);
// Whether oneDNN has native kernels for `dtype` on a CPU of these flags under this cap: only then is there a choice
// to measure (bf16: AVX512-BF16 or AMX-BF16; fp16: AVX512-FP16 or AMX-FP16).
bool native_narrow_kernels(const std::string& flags, const std::string& onednn_max_isa, c10::ScalarType dtype);
// This machine's paths of `dtype` for this process's environment and thread count, whatever is pinned, from the
// stored measurement without measuring: a resumed run compares them with the paths its checkpoint pins.
std::pair<GemmPaths, std::string> machine_gemm_paths(c10::ScalarType dtype);
// "nt=native,nn=widened,tn=widened" as paths; Throws InputError naming `source` when malformed.
GemmPaths parse_gemm_paths(const std::string& description, const std::string& source);

// Call before ATen's and oneDNN's first use (both read their knobs once). torch 2.14.1's bf16 flash attention on
// the CPU packs its blocks for AMX whenever oneDNN may use AMX, with a routine (pack_vnni2) that exists only in
// ATen's AVX-512 kernels: under ATEN_CPU_CAPABILITY=default or avx2 on an AMX CPU every bf16 attention throws
// ("pack_vnni2 is only supported when avx512 is supported"). No CPU pairs AMX with a sub-AVX-512 ATen capability:
// lowering ATen there emulates a CPU without AVX-512, which has no AMX either. So when ATen's capability is set
// below avx512 on an AMX CPU and ONEDNN_MAX_CPU_ISA is unset, this sets it to AVX512_CORE_BF16 (the level just
// below AMX; the bf16 GEMMs then take the path measured for that cap, as on such a CPU) and returns a one-line note saying so;
// otherwise it changes nothing and returns "". Child processes (conform's adapters) inherit the setting.
std::string coherent_cpu_configuration();
// The same decision from given values (the CPU's flags, ATEN_CPU_CAPABILITY's and ONEDNN_MAX_CPU_ISA's; "" when
// unset): the oneDNN cap to set, or "".
std::string onednn_cap_for(const std::string& flags, const std::string& aten_capability, const std::string& onednn_max_isa);
// What the choice was based on, for the run record: "measured <date> (...), stored in <file>", "pinned by
// STREAMBP_NARROW_GEMM=widened", "pinned by <checkpoint>/trainer.json"; "" for a dtype that is never widened.
std::string gemm_paths_reason(c10::ScalarType dtype);
// Every narrow dtype whose paths this process has chosen so far: its name ("bf16") -> {paths, reason}.
std::map<std::string, std::pair<std::string, std::string>> chosen_gemm_paths();
// Pins the paths of `dtype` (a resumed run: the paths its checkpoint recorded). Throws InputError naming
// `source` on a malformed description.
void pin_gemm_paths(c10::ScalarType dtype, const std::string& description, const std::string& source);

// Whether a product of `a` (its dtype and device) in `layout` takes the widened path: only narrow dtypes on the CPU
// (a GPU's bf16 kernels are its fast path).
bool widened(const at::Tensor& a, GemmLayout layout);
// a [m, k] · b [k, n] in a's dtype; `layout` names which of the model's products this is (its path).
at::Tensor gemm(const at::Tensor& a, const at::Tensor& b, GemmLayout layout);
// y = x · wᵀ + bias (x [..., k], w [n, k], bias [n] or undefined), differentiable; the backward's products take
// their own layouts' paths. With every path native this is at::linear itself.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias = {});

}  // namespace sbp
