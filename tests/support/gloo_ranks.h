// `world` ranks as threads of this process, each with its own Gloo group over a FileStore in a fresh temporary
// folder: what the sequence-parallel tests run their ranks on.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>

#include "core/training/c10d_communicator.h"
#include "tests/support/test_support.h"
#include "verify/grad_compare.h"

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

// This rank's loss and gradients summed over the group, against one process's `reference`: the largest relative
// difference (the loss, every gradient normwise). A missing or misshapen gradient throws (run_gloo_ranks rethrows).
inline double group_sum_error(Communicator& comm, StepGradients step, const StepGradients& reference) {
  std::vector<at::Tensor> loss = {at::tensor(step.loss, at::kDouble)};
  comm.all_reduce_sum(loss);
  for (auto& g : step.gradients) {
    std::vector<at::Tensor> one = {g.tensor};  // one tensor per call: Gloo's list is of equal shapes
    comm.all_reduce_sum(one);
  }
  const auto cmp = compare_gradients(reference.gradients, step.gradients);
  if (!cmp.problems.empty()) throw std::runtime_error("rank " + std::to_string(comm.rank()) + ": " + cmp.problems[0]);
  return std::max(std::abs(loss[0].item<double>() - reference.loss) / std::abs(reference.loss), cmp.max_normwise_rel());
}

}  // namespace sbp::test
