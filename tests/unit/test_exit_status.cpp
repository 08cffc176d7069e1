// The CLI's exit-code contract (experiments/exit_status.h): only bad input exits 2; an internal error (a bug: a logic
// error, a failed TORCH_CHECK, anything unexpected) exits 70, so that a test expecting 2 cannot pass on a bug.
#include "experiments/exit_status.h"

#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <catch2/catch.hpp>

#include <filesystem>
#include <new>
#include <stdexcept>
#include <system_error>

#include "core/io/input_error.h"
#include "core/model/chunk_attention_kernels.h"
#include "core/io/safetensors.h"
#include "core/training/communicator.h"
#include "experiments/ranks.h"

using sbp::run_with_exit_status;

TEST_CASE("exit status: a command's own status passes through", "[exit-status]") {
  CHECK(run_with_exit_status([] { return 0; }) == 0);
  CHECK(run_with_exit_status([] { return 1; }) == 1);
  CHECK(run_with_exit_status([] { return 3; }) == 3);
}

TEST_CASE("exit status: bad input exits 2", "[exit-status]") {
  CHECK(run_with_exit_status([]() -> int { throw sbp::InputError("--seq: must be at least 2"); }) == sbp::kExitInput);
  CHECK(run_with_exit_status([]() -> int { throw sbp::FormatError("g.safetensors: truncated"); }) == sbp::kExitInput);
  CHECK(run_with_exit_status([]() -> int {
          throw std::filesystem::filesystem_error("cannot create", "/proc/out",
                                                  std::make_error_code(std::errc::permission_denied));
        }) == sbp::kExitInput);
}

TEST_CASE("exit status: an injected internal error exits 70, not 2", "[exit-status]") {
  CHECK(run_with_exit_status([]() -> int { throw std::logic_error("a slot read before it was written"); }) ==
        sbp::kExitInternal);
  CHECK(run_with_exit_status([]() -> int { TORCH_CHECK(false, "shapes disagree"); }) == sbp::kExitInternal);
  // A std::invalid_argument that is not an InputError (a library's, e.g. std::stoi's) is not a judged input error.
  CHECK(run_with_exit_status([]() -> int { throw std::invalid_argument("stoi"); }) == sbp::kExitInternal);
  CHECK(run_with_exit_status([]() -> int { throw 42; }) == sbp::kExitInternal);
}

TEST_CASE("exit status: out of memory exits 3, a peer rank's failure 1", "[exit-status]") {
  CHECK(run_with_exit_status([]() -> int { throw std::bad_alloc(); }) == sbp::kExitOutOfMemory);
  CHECK(run_with_exit_status([]() -> int {
          throw c10::OutOfMemoryError({__func__, __FILE__, uint32_t(__LINE__)}, "refused 1 GiB");
        }) == sbp::kExitOutOfMemory);
  CHECK(run_with_exit_status([]() -> int { throw sbp::PeerFailure("rank 0: all_reduce failed"); }) == sbp::kExitFailed);
}

TEST_CASE("the ring on a device and dtype without key-block attention is refused as input before any group forms",
          "[exit-status][ring-scheme]") {
  using sbp::SequenceScheme;
  CHECK(sbp::sequence_scheme_problem(SequenceScheme::ring, c10::kCPU, at::kBFloat16).empty());
  CHECK(sbp::sequence_scheme_problem(SequenceScheme::ring, c10::kCPU, at::kDouble).empty());
  // CUDA's 16-bit path (whole-chunk kernels, no key blocks), chosen on this CPU the way tests stand it in: the ring
  // would fail inside a rank's first step (a TORCH_CHECK: exit 70); join_ranks refuses it as input (exit 2).
  const sbp::ScopedCpuWholeChunkKernel whole(sbp::cpu_masked_whole_chunk_kernel());
  const auto problem = sbp::sequence_scheme_problem(SequenceScheme::ring, c10::kCPU, at::kBFloat16);
  INFO(problem);
  CHECK_THAT(problem, Catch::Contains("--sp-scheme ring") && Catch::Contains("--sp-scheme allgather"));
  CHECK(sbp::sequence_scheme_problem(SequenceScheme::allgather, c10::kCPU, at::kBFloat16).empty());
  CHECK(sbp::sequence_scheme_problem(SequenceScheme::ring, c10::kCPU, at::kFloat).empty());
}
