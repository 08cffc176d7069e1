// A Communicator of N ranks that are all this one (for tests that measure or compare one rank in one process).
#pragma once

#include <vector>

#include <ATen/ATen.h>

#include "core/training/communicator.h"

namespace sbp::test {

// N ranks that all hold this rank's batch and gradients, as seen by rank `rank`: the all-reduce multiplies by N, the
// reduce-scatter returns N x this rank's block, the all-gather N copies of this rank's tensor (so the slices of the
// other ranks are not what a real run would gather: these runs are for their bytes, not their values). What each
// collective allocates through the CPU allocator is Gloo's (ProcessGroupGloo.cpp, torch 2.14): the all-reduce works
// in place; the reduce-scatter all-reduces a clone of its input and copies this rank's block into the output; the
// all-gather gathers into a flat buffer of the output's size and copies the output out of it.
class IdenticalRanks final : public Communicator {
 public:
  IdenticalRanks(int world, int rank) : world_(world), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  bool copies_collective_buffers() const override { return true; }
  void all_reduce_sum(std::vector<at::Tensor>& tensors) override {
    for (auto& t : tensors) t.mul_(world_);
  }
  at::Tensor reduce_scatter_sum(const at::Tensor& input) override {
    const auto in = input.contiguous().reshape({-1});
    auto out = at::empty({in.numel() / world_}, in.options());
    auto reduced = in.clone();  // Gloo's clone, all-reduced in place
    reduced.mul_(world_);
    out.copy_(reduced.chunk(world_)[rank_]);
    return out;
  }
  at::Tensor all_gather(const at::Tensor& tensor) override {
    const auto in = tensor.contiguous().reshape({-1});
    auto out = at::empty({world_ * in.numel()}, in.options());
    auto flat = at::empty({world_, in.numel()}, in.options());  // Gloo's flat output
    flat.copy_(in.expand({world_, in.numel()}));
    out.copy_(flat.reshape({-1}));
    std::vector<std::int64_t> sizes = {world_};
    sizes.insert(sizes.end(), tensor.sizes().begin(), tensor.sizes().end());
    return out.view(sizes);
  }
  void barrier() override {}
  // A hop: what Gloo's send and recv allocate, the received tensor (this rank's own, since every rank is this one).
  at::Tensor ring_shift(const at::Tensor& tensor) override {
    return at::empty_like(tensor, at::MemoryFormat::Contiguous).copy_(tensor);
  }

 private:
  int world_, rank_;
};

}  // namespace sbp::test
