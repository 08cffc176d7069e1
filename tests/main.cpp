// Catch2 runner of the test suite. The CPU memory meter must be installed before any tensor exists (DESIGN §7):
// a block allocated earlier is invisible to it, and the meter tests count bytes exactly.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <ATen/Parallel.h>

#include "profiler/cpu_meter.h"

int main(int argc, char* argv[]) {
  sbp::CpuMemoryMeter::install();
  // The machines have 2 cores shared by ctest -j2; a fixed thread count also fixes the CPU reduction order, which
  // the bitwise determinism test relies on.
  at::set_num_threads(2);
  return Catch::Session().run(argc, argv);
}
