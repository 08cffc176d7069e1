// The K/V exchange of a sequence-parallel group over a Communicator (issue #32, ARCHITECTURE.md §16): the layer's K
// and V all-gathered in the forward, their gradients reduce-scattered in the backward, one piece at a time: the
// [..., t, hd] tensor's [t, hd] slices (a row's K or V of one KV head) in at most 4 pieces of consecutive slices, so
// that a collective's buffers are N pieces, a quarter of the whole K/V or less (all of it at once, N copies of the
// whole K/V outgrew the K/V themselves; a quarter keeps StreamBP's chunk loop its peak, ARCHITECTURE.md §16). Shards of
// unequal length (T not divisible by 2N) travel padded to the longest; the padding is never read.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/model/context_attention.h"
#include "core/training/communicator.h"
#include "core/training/sequence_scheme.h"

namespace sbp {

// The K/V source of this rank of `group` for sequences of seq_len positions (the zig-zag split).
std::unique_ptr<KVSource> make_sequence_exchange(SequenceScheme scheme, Communicator& group, std::int64_t seq_len);

// [..., t, hd] -> [..., padded, hd], zeros after t (how shards of unequal length travel).
at::Tensor pad_positions(const at::Tensor& x, std::int64_t padded);

class SequenceParallel final : public KVExchange {
 public:
  // `comm`: the group (its ranks are the shards'); it must outlive this. The zig-zag split of seq_len positions, or
  // any split given as every rank's shard in rank order (blocks of all ranks tiling [0, seq_len)).
  SequenceParallel(Communicator& comm, std::int64_t seq_len);
  SequenceParallel(Communicator& comm, std::vector<SequenceShard> split);
  const SequenceShard& shard() const override { return shards_[std::size_t(comm_.rank())]; }
  at::Tensor gather(const at::Tensor& local) override;
  at::Tensor scatter_sum(const at::Tensor& whole) override;
  void sum_over_group(at::Tensor& values) override;
  // The longest shard's positions: what every rank's share is padded to.
  std::int64_t padded_length() const { return padded_; }

 private:
  Communicator& comm_;
  std::vector<SequenceShard> shards_;
  std::int64_t padded_ = 0;
};

// The collectives of one exchange of `slices` slices of `slice_position_bytes` bytes per position (hd * element
// bytes), on one rank: exchange_pieces(slices) calls each way; the all-gathers are handed t padded positions per
// slice, the reduce-scatters N * t (t the longest shard). What the accounting test checks.
struct ExchangeCost {
  std::int64_t calls = 0, all_gather_bytes = 0, reduce_scatter_bytes = 0;
};
ExchangeCost exchange_cost(std::int64_t seq_len, int world, std::int64_t slices, std::int64_t slice_position_bytes);

// What one training step of a rank moves on its sequence-parallel group (Trainer with TrainOptions::sequence_group).
struct SequenceStep {
  std::int64_t seq_len = 0;
  int world = 1;  // the group's ranks
  int layers = 0;
  std::int64_t micro_batches = 1;
  std::int64_t slices = 2;  // K and V of every row and KV head: 2 * rows * n_kv
  std::int64_t slice_position_bytes = 0;  // head_dim * element bytes
  int gathers_per_layer = 1;        // forward passes over each layer: standard BP 1; checkpointing, StreamBP 2
  std::int64_t statistics_bytes = 0;  // an objective's row statistics (rows * 8, fp64), 0 without a row term
  SequenceScheme scheme = SequenceScheme::allgather;
  std::int64_t sum_position_bytes = 0;  // the ring's dK/dV sums: head_dim * their element bytes (0: as the slices)
};
// Calls and bytes per collective kind, as Communicator::stats() counts them: per micro-batch and layer
// gathers_per_layer exchanges' all-gathers and one exchange's reduce-scatters (exchange_cost), per micro-batch one
// all-reduce of the row
// statistics (if any), per step one all-gather of the sequence length (the ranks' agreement, 8 bytes). The ring
// (RingExchange) has no all-gathers or reduce-scatters per layer but hops ("ring_shift"): per micro-batch and layer
// N - 1 of the rank's padded K/V block per forward pass, and in the backward N - 1 more of the block and N of its sums.
std::int64_t ring_hops_per_layer(int world, int forward_passes);
std::map<std::string, CollectiveStats> sequence_step_collectives(const SequenceStep& step);

}  // namespace sbp
