// Catch2 runner of the test suite. The CPU memory meter must be installed before any tensor exists (DESIGN §7):
// a block allocated earlier is invisible to it, and the meter tests count bytes exactly.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdlib>
#include <string>

#include <ATen/Parallel.h>

#include "profiler/cpu_meter.h"

int main(int argc, char* argv[]) {
  sbp::CpuMemoryMeter::install();
  Catch::Session session;
  // --onednn-max-cpu-isa AVX2: run this process on a lower instruction set, as a CPU without the native ones would
  // (tests/CMakeLists.txt registers the memory-model tests once per ISA). It must be set before oneDNN's first use.
  std::string isa;
  session.cli(session.cli() | Catch::clara::Opt(isa, "ISA")["--onednn-max-cpu-isa"](
                                  "ONEDNN_MAX_CPU_ISA for this process (e.g. AVX512_CORE, AVX2)"));
  if (const int rc = session.applyCommandLine(argc, argv)) return rc;
  if (!isa.empty()) setenv("ONEDNN_MAX_CPU_ISA", isa.c_str(), 1);
  // The machines have 2 cores shared by ctest -j2; a fixed thread count also fixes the CPU reduction order, which
  // the bitwise determinism test relies on.
  at::set_num_threads(2);
  return session.run();
}
