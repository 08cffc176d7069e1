// `world` ranks as threads of this process, each with its own Gloo group over a FileStore in a fresh temporary
// folder: what the sequence-parallel tests run their ranks on.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>

#include "core/training/c10d_communicator.h"
#include "tests/support/test_support.h"

namespace sbp::test {

// body(comm) on every rank, one intra-op thread each; rethrows the first rank's error.
inline void run_gloo_ranks(int world, const std::function<void(Communicator&)>& body) {
  const TempDir dir("sbp_sp_");
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank)
    threads.emplace_back([&, rank] {
      try {
        at::set_num_threads(1);
        auto comm = make_gloo_communicator({.rank = rank, .world_size = world,
                                            .file_store = (dir.path() / "store").string(),
                                            .timeout = std::chrono::seconds(60)});
        body(*comm);
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace sbp::test
