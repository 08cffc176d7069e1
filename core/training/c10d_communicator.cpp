#include "core/training/c10d_communicator.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <stdexcept>
#include <thread>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "core/training/c10d_backend.h"

namespace sbp {
namespace {

std::int64_t bytes_of(const std::vector<at::Tensor>& tensors) {
  std::int64_t n = 0;
  for (const auto& t : tensors) n += std::int64_t(t.nbytes());
  return n;
}

std::string first_line(std::string message) {
  if (const auto nl = message.find('\n'); nl != std::string::npos) message.resize(nl);
  return message;
}

// Any c10d backend (ProcessGroupGloo, ProcessGroupNCCL): the collectives as the Communicator states them.
class BackendCommunicator final : public Communicator {
 public:
  // Forms the group of rank o.rank in o.world_size through `store` (the whole group's, or a subgroup's prefix of it).
  BackendCommunicator(detail::BackendFactory factory, c10::intrusive_ptr<c10d::Store> store, const RendezvousOptions& o,
                      c10::Device device, bool copies_buffers)
      : rank_(o.rank), world_(o.world_size), device_(device), copies_buffers_(copies_buffers),
        factory_(std::move(factory)), store_(std::move(store)), options_(o) {
    try {
      group_ = factory_(store_, rank_, world_);
    } catch (const std::exception& e) {
      throw PeerFailure(detail::rendezvous_failure(o, e.what()));
    }
  }
  // NCCL wants its group ended explicitly (its destructor otherwise warns and aborts): shut down cleanly after normal
  // use, as destroy_process_group does; aborted while an exception unwinds, when a collective may be stuck on a dead
  // peer. Both are no-ops for Gloo.
  ~BackendCommunicator() override {
    try {
      if (std::uncaught_exceptions() > 0)
        group_->abort();
      else
        group_->shutdown();
    } catch (const std::exception&) {
      // nothing left to report to: the group is going away either way
    }
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  c10::Device device() const override { return device_; }
  bool copies_collective_buffers() const override { return copies_buffers_; }

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
    if (copies_buffers_) {
      // Gloo's own reduce-scatter (ProcessGroupGloo::reduce_scatter_tensor_coalesced, torch 2.14) all-reduces a clone
      // of the input and copies this rank's block out, from an inner work this class cannot wait to be released
      // (wait below): the same steps here, with the same buffers, so that the clone is gone when this returns.
      std::vector<at::Tensor> reduced = {in.clone()};
      c10d::AllreduceOptions options;
      options.reduceOp = c10d::ReduceOp::SUM;
      wait("reduce_scatter", group_->allreduce(reduced, options));
      out.copy_(reduced[0].chunk(world_)[rank_]);
      return out;
    }
    c10d::ReduceScatterOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    wait("reduce_scatter", group_->_reduce_scatter_base(out, in, options));
    return out;
  }

  at::Tensor all_gather(const at::Tensor& tensor) override {
    // Flat buffers: world x numel elements out, in rank order.
    auto in = tensor.contiguous().reshape({-1});
    auto out = at::empty({world_ * in.numel()}, in.options());
    count("all_gather", std::int64_t(in.nbytes()));
    wait("all_gather", group_->_allgather_base(out, in));
    std::vector<std::int64_t> sizes = {world_};
    sizes.insert(sizes.end(), tensor.sizes().begin(), tensor.sizes().end());
    return out.view(sizes);
  }

  void barrier() override { wait("barrier", group_->barrier()); }

  at::Tensor ring_shift(const at::Tensor& tensor) override {
    std::vector<at::Tensor> out = {at::empty_like(tensor, at::MemoryFormat::Contiguous)};
    count("ring_shift", std::int64_t(tensor.nbytes()));
    if (world_ == 1) return out[0].copy_(tensor);
    std::vector<at::Tensor> in = {tensor.contiguous()};
    const int next = (rank_ + 1) % world_, previous = (rank_ + world_ - 1) % world_;
    const auto to = "ring_shift (send to rank " + std::to_string(next) + ")",
               from = "ring_shift (recv from rank " + std::to_string(previous) + ")";
    // Both posted before either is waited on. Under NCCL a send waits for its receiver, and at N = 2 the send and the
    // recv go to one peer on one stream, run in the order posted: if both ranks posted their send first, each would
    // wait on a recv queued behind it. So odd ranks post the recv first (any cycle of ranks holds one). Gloo posts
    // on this thread: a peer already gone throws here.
    c10::intrusive_ptr<c10d::Work> sent, received;
    const bool send_first = rank_ % 2 == 0;
    const std::string* posting = send_first ? &to : &from;
    try {
      if (send_first) {
        sent = group_->send(in, next, /*tag=*/0);
        posting = &from;
        received = group_->recv(out, previous, /*tag=*/0);
      } else {
        received = group_->recv(out, previous, /*tag=*/0);
        posting = &to;
        sent = group_->send(in, next, /*tag=*/0);
      }
    } catch (const std::exception& e) {
      throw peer_failure(*posting, e);
    }
    // Not released: Gloo keeps a point-to-point work referenced past its wait, so release() would spin for its whole
    // second on every hop; a hop's buffers are the ring's own, held by it anyway.
    wait(to, sent, /*release_buffers=*/false);
    wait(from, received, /*release_buffers=*/false);
    return out[0];
  }

  std::unique_ptr<Communicator> subgroup(const std::string& name, const std::vector<int>& members) override {
    const auto me = std::find(members.begin(), members.end(), rank_);
    TORCH_CHECK(me != members.end() && std::is_sorted(members.begin(), members.end()), "subgroup ", name, ": rank ",
                rank_, " is not among its members");
    auto o = options_;
    o.rank = int(me - members.begin());
    o.world_size = int(members.size());
    if (!o.file_store.empty()) o.file_store += " (subgroup " + name + ")";  // for messages: the store is store_'s
    return std::make_unique<BackendCommunicator>(factory_, c10::make_intrusive<c10d::PrefixStore>(name, store_), o,
                                                 device_, copies_buffers_);
  }

 private:
  // Gloo reports a dead or stalled peer from wait() (its own exception types, std::runtime_error underneath); NCCL's
  // wait() only orders the current stream after the collective and throws when the work already failed (its watchdog
  // aborts the process when a collective outlives the timeout).
  void wait(const std::string& what, c10::intrusive_ptr<c10d::Work> work, bool release_buffers = true) const {
    try {
      work->wait();
    } catch (const std::exception& e) {
      throw peer_failure(what, e);
    }
    if (copies_buffers_ && release_buffers) release(work);
  }
  PeerFailure peer_failure(const std::string& what, const std::exception& e) const {
    return PeerFailure("rank " + std::to_string(rank_) + ": " + what + " failed (a peer died or stalled?): " +
                       first_line(e.what()));
  }
  // Gloo's wait() returns when the work's future completes; its worker thread drops its own reference to the work
  // (and so to the tensors the work holds: the inputs, the outputs) only after that. On a busy machine that comes
  // late, and one collective's buffers were still alive at the next moments of the step (tiny, 2 ranks on 2 cores:
  // rank 0's peak 5.7-7.9% above its model, varying run to run, by the previous layer's flattened gradients). So a
  // collective returns once the work is this caller's alone (bounded: a reference kept elsewhere only costs time).
  static void release(c10::intrusive_ptr<c10d::Work>& work) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (work.use_count() > 1 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    work.reset();
  }

  int rank_, world_;
  c10::Device device_;
  bool copies_buffers_;
  detail::BackendFactory factory_;  // and the store: to form subgroups
  c10::intrusive_ptr<c10d::Store> store_;
  RendezvousOptions options_;
  c10::intrusive_ptr<c10d::Backend> group_;
};

}  // namespace

namespace detail {

c10::intrusive_ptr<c10d::Store> make_store(const RendezvousOptions& o) {
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
  return store;
}

std::unique_ptr<Communicator> make_backend_communicator(const BackendFactory& factory, const RendezvousOptions& options,
                                                        c10::Device device, bool copies_buffers) {
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = make_store(options);
  } catch (const std::exception& e) {
    throw PeerFailure(rendezvous_failure(options, e.what()));
  }
  return std::make_unique<BackendCommunicator>(factory, std::move(store), options, device, copies_buffers);
}

std::string rendezvous_failure(const RendezvousOptions& options, const std::string& what) {
  return "rank " + std::to_string(options.rank) + " of " + std::to_string(options.world_size) +
         ": no process group through " +
         (options.file_store.empty() ? options.master_addr + ":" + std::to_string(options.master_port)
                                     : options.file_store) +
         " within the timeout: " + first_line(what);
}

}  // namespace detail

std::unique_ptr<Communicator> make_gloo_communicator(const RendezvousOptions& o) {
  const auto timeout = o.timeout;
  const detail::BackendFactory gloo = [timeout](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size) {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    return c10::intrusive_ptr<c10d::Backend>(c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options));
  };
  return detail::make_backend_communicator(gloo, o, c10::Device(c10::kCPU), /*copies_buffers=*/true);
}

}  // namespace sbp
