// make_nccl_communicator (c10d_communicator.h): without a GPU (these machines have none) it refuses with a
// an InputError naming the rank and the missing CUDA device, before any rendezvous (the store's peer never comes
// here, so a refusal after it would take the whole timeout), and never crashes; a build without CUDA refuses with the
// stub's message. With a GPU (tests/gpu/run.sh step 1): a group of one rank on cuda:0 runs every collective in
// place on the device, and a device that does not exist is refused the same way.
#include <catch2/catch.hpp>

#include <chrono>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <string>

#include <ATen/ATen.h>

#include "core/io/input_error.h"
#include "core/training/c10d_communicator.h"
#include "profiler/cuda_memory.h"

namespace {

struct TemporaryStore {
  std::filesystem::path dir = std::filesystem::temp_directory_path() /
                              ("streambp-test-nccl-" + std::to_string(std::mt19937_64(std::random_device{}())()));
  TemporaryStore() { std::filesystem::create_directories(dir); }
  ~TemporaryStore() { std::filesystem::remove_all(dir); }
  std::string path() const { return (dir / "store").string(); }
};

std::string refusal(const sbp::RendezvousOptions& options, int device_index) {
  try {
    sbp::make_nccl_communicator(options, device_index);
  } catch (const sbp::InputError& e) {
    return e.what();
  }
  FAIL("make_nccl_communicator did not throw");
  return {};
}

}  // namespace

TEST_CASE("make_nccl_communicator refuses without a CUDA device, naming the rank, before the rendezvous (cuda)",
          "[distributed][cuda][needs-gpu]") {
  const TemporaryStore store;
  // Rank 1 of 2: rank 0 never comes, so only a refusal ahead of the rendezvous returns before the timeout.
  const sbp::RendezvousOptions options{.rank = 1, .world_size = 2, .file_store = store.path(),
                                       .timeout = std::chrono::seconds(30)};
  const auto start = std::chrono::steady_clock::now();
#ifndef STREAMBP_WITH_CUDA
  const auto message = refusal(options, 0);
  INFO(message);
  CHECK_THAT(message, Catch::Contains("rank 1 of 2") &&
                          Catch::Contains("NCCL: this build has no CUDA (STREAMBP_WITH_CUDA=OFF)"));
#else
  if (sbp::cuda_device_available()) {
    const auto message = refusal(options, sbp::cuda_device_count());  // one past the last device
    INFO(message);
    CHECK_THAT(message, Catch::Contains("rank 1 of 2") && Catch::Contains("NCCL") &&
                            Catch::Contains("no CUDA device " + std::to_string(sbp::cuda_device_count())));
  } else {
    for (const int device : {0, 3}) {
      const auto message = refusal(options, device);
      INFO(message);
      CHECK_THAT(message, Catch::Contains("rank 1 of 2") && Catch::Contains("NCCL needs a CUDA device") &&
                              Catch::Contains("no CUDA device is available"));
    }
  }
#endif
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
}

TEST_CASE("an NCCL group of one rank runs every collective on its GPU (cuda)", "[distributed][cuda]") {
  if (!sbp::cuda_device_available()) {  // CTest reports the skip; the refusal is tested above
    WARN("SKIPPED: no GPU");
    return;
  }
  const TemporaryStore store;
  auto comm = sbp::make_nccl_communicator({.rank = 0, .world_size = 1, .file_store = store.path(),
                                           .timeout = std::chrono::seconds(60)}, 0);
  CHECK(comm->device() == c10::Device(c10::kCUDA, 0));
  const auto cuda = at::TensorOptions(at::kDouble).device(comm->device());
  std::vector<at::Tensor> t = {at::arange(6, cuda), at::tensor(std::vector<std::int64_t>{7, 8}, at::TensorOptions(at::kLong).device(comm->device()))};
  comm->all_reduce_sum(t);  // one rank: the sum is the tensor itself
  CHECK(at::equal(t[0].cpu(), at::arange(6, at::kDouble)));
  CHECK(t[1][1].item<std::int64_t>() == 8);
  const auto mine = comm->reduce_scatter_sum(at::arange(4, cuda));
  CHECK(mine.device() == comm->device());
  CHECK(at::equal(mine.cpu(), at::arange(4, at::kDouble)));
  const auto all = comm->all_gather(at::ones({2, 3}, cuda));
  CHECK(all.sizes() == at::IntArrayRef({1, 2, 3}));
  comm->barrier();
  CHECK(comm->stats().at("all_reduce").calls == 1);
  CHECK(comm->stats().at("all_reduce").bytes == 6 * 8 + 2 * 8);
  CHECK(comm->stats().at("reduce_scatter").bytes == 4 * 8);
  CHECK(comm->stats().at("all_gather").bytes == 6 * 8);
}
