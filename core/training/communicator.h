// What data-parallel training needs from a process group (ARCHITECTURE.md §12), without c10d's headers: sums across ranks
// in place, a gather, a barrier, and the bytes and calls each collective moved (the run's communication accounting).
// The implementations over torch's c10d (Gloo on the CPU, NCCL on a CUDA device) are in
// core/training/c10d_communicator.h; world size 1 needs none.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace sbp {

// A rendezvous or collective that failed because a peer died, stalled or never came: neither this rank's input nor
// its bug. The CLI exits 1 on it; the launcher names the rank that failed first, with that rank's own exit code.
struct PeerFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct CollectiveStats {
  std::int64_t calls = 0, bytes = 0;  // bytes: of the tensors handed to the collective on this rank
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Where the tensors handed to the collectives must live (Gloo: the CPU; NCCL: this rank's CUDA device); what they
  // return lives there too.
  virtual c10::Device device() const = 0;
  // Element-wise SUM over ranks, in place, as one collective (never AVG: ARCHITECTURE.md §12).
  virtual void all_reduce_sum(std::vector<at::Tensor>& tensors) = 0;
  // `input` is N equal consecutive blocks (N = world size); returns the SUM over ranks of block `rank()`.
  virtual at::Tensor reduce_scatter_sum(const at::Tensor& input) = 0;
  // Every rank's `tensor` (same shape on all), stacked along a new first dimension in rank order.
  virtual at::Tensor all_gather(const at::Tensor& tensor) = 0;
  virtual void barrier() = 0;
  // A ring's hop: `tensor` sent to rank (rank() + 1) mod N, the one rank (rank() - 1) mod N sent returned (the same
  // shape on every rank). Counted as "ring_shift", the bytes sent. Throws std::logic_error where not implemented.
  virtual at::Tensor ring_shift(const at::Tensor& /*tensor*/) {
    throw std::logic_error("this communicator has no point-to-point hop (ring_shift)");
  }
  // Whether reduce_scatter_sum and all_gather allocate one more buffer of their whole [N, length] size while they run
  // (the memory models count it, Workload::collective_copies): Gloo's reduce-scatter all-reduces a clone of its input
  // and its all-gather gathers into a flat buffer it then copies out of (ProcessGroupGloo.cpp, torch 2.14); NCCL
  // reads and writes the tensors it is given. Either way nothing a collective allocates outlives its call.
  virtual bool copies_collective_buffers() const { return false; }
  // A group of the ranks `members` of this one (ascending, this rank among them), formed through this group's
  // rendezvous under `name`; every member calls it with the same arguments, no other rank takes part. A
  // sequence-parallel group's collectives run there, beside the data-parallel ones on the whole group (ARCHITECTURE.md
  // §16). Its accounting is its own. Throws std::logic_error where the implementation forms none.
  virtual std::unique_ptr<Communicator> subgroup(const std::string& name, const std::vector<int>& /*members*/) {
    throw std::logic_error("this communicator forms no subgroup (" + name + ")");
  }

  // Per collective kind ("all_reduce", "reduce_scatter", "all_gather"), since construction or the last reset.
  const std::map<std::string, CollectiveStats>& stats() const { return stats_; }
  void reset_stats() { stats_.clear(); }

 protected:
  void count(const std::string& kind, std::int64_t bytes) {
    auto& s = stats_[kind];
    ++s.calls;
    s.bytes += bytes;
  }

 private:
  std::map<std::string, CollectiveStats> stats_;
};

// The first of `values` (the same number of them on every rank of `comm`) that some rank holds differently from rank
// 0, and both values; nullopt when all agree. One all-gather, whose answer every rank gets: they fail together, where
// settings compared one rank at a time would leave some waiting in a collective the others never reach.
struct Disagreement {
  int rank;           // the lowest rank that differs from rank 0 on this value
  std::size_t index;  // which value
  std::int64_t theirs, rank0;
};
std::optional<Disagreement> first_disagreement(Communicator& comm, const std::vector<std::int64_t>& values);

}  // namespace sbp
