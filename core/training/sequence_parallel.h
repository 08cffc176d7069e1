// The K/V exchange of a sequence-parallel group over a Communicator (issue #32, ARCHITECTURE.md §16): one all-gather
// of the layer's K and V together in the forward, one reduce-scatter of their gradients in the backward. Shards of
// unequal length (T not divisible by 2N) travel padded to the longest; the padding is never read.
//
// Per layer and step, with t the longest shard, B·n_kv·hd·elem bytes per position and K and V stacked: all_gather one
// call of 2·t positions handed in; reduce_scatter one call of N·2·t positions handed in (collective_bytes).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/model/context_attention.h"
#include "core/training/communicator.h"

namespace sbp {

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

// Bytes handed to the collectives of one exchange of a [..., t, hd] tensor whose per-position slice has
// `position_bytes` bytes: {all_gather, reduce_scatter} on one rank, the analytic count the accounting test checks.
struct ExchangeBytes {
  std::int64_t all_gather = 0, reduce_scatter = 0;
};
ExchangeBytes exchange_bytes(std::int64_t seq_len, int world, std::int64_t position_bytes);

// What one training step of a rank moves on its sequence-parallel group (Trainer with TrainOptions::sequence_group).
struct SequenceStep {
  std::int64_t seq_len = 0;
  int world = 1;  // the group's ranks
  int layers = 0;
  std::int64_t micro_batches = 1;
  std::int64_t position_bytes = 0;  // K and V of one position of every row: 2 * rows * n_kv * head_dim * element bytes
  int gathers_per_layer = 1;        // forward passes over each layer: standard BP 1; checkpointing, StreamBP 2
  std::int64_t statistics_bytes = 0;  // an objective's row statistics (rows * 8, fp64), 0 without a row term
};
// Calls and bytes per collective kind, as Communicator::stats() counts them: per micro-batch and layer
// gathers_per_layer all-gathers and one reduce-scatter (exchange_bytes), per micro-batch one all-reduce of the row
// statistics (if any), per step one all-gather of the sequence length (the ranks' agreement, 8 bytes).
std::map<std::string, CollectiveStats> sequence_step_collectives(const SequenceStep& step);

}  // namespace sbp
