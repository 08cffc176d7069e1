#include "core/training/sequence_parallel.h"

#include <algorithm>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace sbp {

namespace {

std::int64_t longest(const std::vector<SequenceShard>& shards) {
  std::int64_t n = 0;
  for (const auto& s : shards) n = std::max(n, s.length());
  return n;
}

// [..., t, hd] -> [..., padded, hd], zeros after t.
at::Tensor pad_positions(const at::Tensor& x, std::int64_t padded) {
  const auto t = x.size(-2);
  if (t == padded) return x.contiguous();
  auto sizes = x.sizes().vec();
  sizes[sizes.size() - 2] = padded;
  auto out = at::zeros(sizes, x.options());
  out.narrow(-2, 0, t).copy_(x);
  return out;
}

}  // namespace

SequenceParallel::SequenceParallel(Communicator& comm, std::int64_t seq_len)
    : SequenceParallel(comm, zigzag_shards(seq_len, comm.world_size())) {}

SequenceParallel::SequenceParallel(Communicator& comm, std::vector<SequenceShard> split)
    : comm_(comm), shards_(std::move(split)), padded_(longest(shards_)) {
  TORCH_CHECK(int(shards_.size()) == comm.world_size(), "SequenceParallel: ", shards_.size(), " shards for ",
              comm.world_size(), " ranks");
}

at::Tensor SequenceParallel::gather(const at::Tensor& local) {
  TORCH_CHECK(local.size(-2) == shard().length(), "SequenceParallel::gather: ", local.size(-2), " positions on rank ",
              shard().rank, ", whose shard has ", shard().length());
  const auto all = comm_.all_gather(pad_positions(local, padded_));  // [N, ..., padded, hd]
  // Every rank's blocks copied to their global positions: together they tile [0, T).
  auto sizes = local.sizes().vec();
  sizes[sizes.size() - 2] = shard().seq_len;
  auto whole = at::empty(sizes, local.options());
  for (const auto& s : shards_)
    s.for_each_block([&](const SequenceShard::Block& b, std::int64_t offset) {
      whole.narrow(-2, b.start, b.length()).copy_(all[s.rank].narrow(-2, offset, b.length()));
    });
  return whole;
}

at::Tensor SequenceParallel::scatter_sum(const at::Tensor& whole) {
  TORCH_CHECK(whole.size(-2) == shard().seq_len, "SequenceParallel::scatter_sum: ", whole.size(-2),
              " positions for a sequence of ", shard().seq_len);
  // Block r of the collective's input: rank r's positions, in its shard order, zeros after them (one buffer, written
  // in place: no per-rank copies).
  auto sizes = whole.sizes().vec();
  sizes[sizes.size() - 2] = padded_;
  std::vector<std::int64_t> stacked = {std::int64_t(shards_.size())};
  stacked.insert(stacked.end(), sizes.begin(), sizes.end());
  auto blocks = at::empty(stacked, whole.options());
  for (const auto& s : shards_) {
    auto block = blocks[s.rank];
    s.for_each_block([&](const SequenceShard::Block& b, std::int64_t offset) {
      block.narrow(-2, offset, b.length()).copy_(whole.narrow(-2, b.start, b.length()));
    });
    if (s.length() < padded_) block.narrow(-2, s.length(), padded_ - s.length()).zero_();
  }
  const auto mine = comm_.reduce_scatter_sum(blocks).view(sizes);
  return mine.narrow(-2, 0, shard().length());
}

void SequenceParallel::sum_over_group(at::Tensor& values) {
  std::vector<at::Tensor> one = {values};
  comm_.all_reduce_sum(one);
}

ExchangeBytes exchange_bytes(std::int64_t seq_len, int world, std::int64_t position_bytes) {
  const auto padded = longest_zigzag_shard(seq_len, world);
  return {padded * position_bytes, std::int64_t(world) * padded * position_bytes};
}

std::map<std::string, CollectiveStats> sequence_step_collectives(const SequenceStep& s) {
  const auto exchange = exchange_bytes(s.seq_len, s.world, s.position_bytes);
  const auto per_step = s.micro_batches * s.layers;
  std::map<std::string, CollectiveStats> out;
  out["all_gather"] = {1 + per_step * s.gathers_per_layer, 8 + per_step * s.gathers_per_layer * exchange.all_gather};
  out["reduce_scatter"] = {per_step, per_step * exchange.reduce_scatter};
  if (s.statistics_bytes > 0) out["all_reduce"] = {s.micro_batches, s.micro_batches * s.statistics_bytes};
  return out;
}

}  // namespace sbp
