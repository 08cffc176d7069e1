#include "core/training/c10d_communicator.h"

#include <stdexcept>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace sbp {
namespace {

std::int64_t bytes_of(const std::vector<at::Tensor>& tensors) {
  std::int64_t n = 0;
  for (const auto& t : tensors) n += std::int64_t(t.nbytes());
  return n;
}

class GlooCommunicator final : public Communicator {
 public:
  explicit GlooCommunicator(const RendezvousOptions& o) : rank_(o.rank), world_(o.world_size) {
    c10::intrusive_ptr<c10d::Store> store;
    if (!o.file_store.empty()) {
      store = c10::make_intrusive<c10d::FileStore>(o.file_store, o.world_size);
    } else {
      c10d::TCPStoreOptions tcp;
      tcp.port = std::uint16_t(o.master_port);
      tcp.isServer = o.rank == 0;
      tcp.numWorkers = o.world_size;
      tcp.timeout = o.timeout;
      store = c10::make_intrusive<c10d::TCPStore>(o.master_addr, tcp);
    }
    store->setTimeout(o.timeout);
    auto options = c10d::ProcessGroupGloo::Options::create(o.timeout);
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    group_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, o.rank, o.world_size, options);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }

  void all_reduce_sum(std::vector<at::Tensor>& tensors) override {
    count("all_reduce", bytes_of(tensors));
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    wait("all_reduce", group_->allreduce(tensors, options));
  }

  at::Tensor reduce_scatter_sum(const at::Tensor& input) override {
    auto in = input.contiguous().reshape({-1});
    TORCH_CHECK(in.numel() % world_ == 0, "reduce_scatter_sum: ", in.numel(), " elements in ", world_, " blocks");
    auto out = at::empty({in.numel() / world_}, in.options());
    count("reduce_scatter", std::int64_t(in.nbytes()));
    c10d::ReduceScatterOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    wait("reduce_scatter", group_->_reduce_scatter_base(out, in, options));
    return out;
  }

  at::Tensor all_gather(const at::Tensor& tensor) override {
    // Gloo gathers flat buffers: world x numel elements out, in rank order.
    auto in = tensor.contiguous().reshape({-1});
    auto out = at::empty({world_ * in.numel()}, in.options());
    count("all_gather", std::int64_t(in.nbytes()));
    wait("all_gather", group_->_allgather_base(out, in));
    std::vector<std::int64_t> sizes = {world_};
    sizes.insert(sizes.end(), tensor.sizes().begin(), tensor.sizes().end());
    return out.view(sizes);
  }

  void barrier() override { wait("barrier", group_->barrier()); }

 private:
  // Gloo reports a dead or stalled peer from wait() (its own exception types, std::runtime_error underneath).
  void wait(const char* what, const c10::intrusive_ptr<c10d::Work>& work) const {
    try {
      work->wait();
    } catch (const std::exception& e) {
      std::string message = e.what();
      if (const auto nl = message.find('\n'); nl != std::string::npos) message.resize(nl);
      throw std::runtime_error("rank " + std::to_string(rank_) + ": " + what + " failed (a peer died or stalled?): " +
                               message);
    }
  }

  int rank_, world_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
};

}  // namespace

std::unique_ptr<Communicator> make_gloo_communicator(const RendezvousOptions& options) {
  try {
    return std::make_unique<GlooCommunicator>(options);
  } catch (const std::exception& e) {
    std::string message = e.what();
    if (const auto nl = message.find('\n'); nl != std::string::npos) message.resize(nl);
    throw std::runtime_error("rank " + std::to_string(options.rank) + " of " + std::to_string(options.world_size) +
                             ": no process group through " +
                             (options.file_store.empty() ? options.master_addr + ":" + std::to_string(options.master_port)
                                                         : options.file_store) +
                             " within the timeout: " + message);
  }
}

}  // namespace sbp
