// Catch2 runner of the test suite. The CPU memory meter must be installed before any tensor exists (ARCHITECTURE.md §7):
// a block allocated earlier is invisible to it, and the meter tests count bytes exactly.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <ATen/Parallel.h>

#include "core/io/process_exit.h"
#include "core/model/gemm.h"
#include "profiler/cpu_meter.h"

namespace {

int run_tests(int argc, char* argv[]) {
  sbp::CpuMemoryMeter::install();
  Catch::Session session;
  // --env NAME=VALUE: run this process under a CPU configuration (ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=default,
  // STREAMBP_NARROW_GEMM=widened), as a CPU without the native instruction sets would (tests/CMakeLists.txt registers
  // the verdicts and the kernel-dependent memory models once per configuration). Set before ATen's and oneDNN's first
  // use, which read them once. --onednn-max-cpu-isa ISA is --env ONEDNN_MAX_CPU_ISA=ISA.
  std::string isa, env;
  session.cli(session.cli() |
              Catch::clara::Opt(isa, "ISA")["--onednn-max-cpu-isa"]("ONEDNN_MAX_CPU_ISA for this process (e.g. AVX2)") |
              Catch::clara::Opt(env, "NAME=VALUE")["--env"]("an environment variable for this process"));
  if (const int rc = session.applyCommandLine(argc, argv)) return rc;
  // Nothing timed in a test: the machine's stored GEMM paths, never a measurement (core/model/gemm.h).
  setenv("STREAMBP_GEMM_PROBE", "off", 1);
  if (!isa.empty()) setenv("ONEDNN_MAX_CPU_ISA", isa.c_str(), 1);
  if (const auto eq = env.find('='); eq != std::string::npos) setenv(env.substr(0, eq).c_str(), env.substr(eq + 1).c_str(), 1);
  // A lowered ATen capability on an AMX CPU: oneDNN capped to match (core/model/gemm.h).
  if (const auto note = sbp::coherent_cpu_configuration(); !note.empty()) std::fprintf(stderr, "%s\n", note.c_str());
  // The machines have 2 cores shared by ctest -j2; a fixed thread count also fixes the CPU reduction order, which
  // the bitwise determinism test relies on.
  at::set_num_threads(2);
  return session.run();
}

}  // namespace

// The session destroyed (its reporters have written), the process ends without libtorch's static teardown
// (core/io/process_exit.h): ~0.14 CPU-s of each of the suite's ~300 test processes.
int main(int argc, char* argv[]) { sbp::exit_without_teardown(run_tests(argc, argv)); }
