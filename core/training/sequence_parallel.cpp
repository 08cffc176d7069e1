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
// [..., t, hd] as [P, t, hd] (a view): the exchange's pieces, one collective each, so that its buffers are one
// piece's (one row's K or V of one KV head) and never the whole tensor's (ARCHITECTURE.md §16).
at::Tensor pieces(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 2 && x.is_contiguous(), "SequenceParallel: a contiguous [..., t, hd] tensor");
  return x.view({-1, x.size(-2), x.size(-1)});
}

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
  auto sizes = local.sizes().vec();
  sizes[sizes.size() - 2] = shard().seq_len;
  auto whole = at::empty(sizes, local.options());
  const auto local_pieces = pieces(local.contiguous()), whole_pieces = pieces(whole);
  for (std::int64_t p = 0; p < local_pieces.size(0); ++p) {
    const auto all = comm_.all_gather(pad_positions(local_pieces[p], padded_));  // [N, padded, hd]
    // Every rank's blocks copied to their global positions: together they tile [0, T).
    for (const auto& s : shards_)
      s.for_each_block([&](const SequenceShard::Block& b, std::int64_t offset) {
        whole_pieces[p].narrow(-2, b.start, b.length()).copy_(all[s.rank].narrow(-2, offset, b.length()));
      });
  }
  return whole;
}

at::Tensor SequenceParallel::scatter_sum(const at::Tensor& whole) {
  TORCH_CHECK(whole.size(-2) == shard().seq_len, "SequenceParallel::scatter_sum: ", whole.size(-2),
              " positions for a sequence of ", shard().seq_len);
  auto sizes = whole.sizes().vec();
  sizes[sizes.size() - 2] = shard().length();
  auto mine = at::empty(sizes, whole.options());
  const auto whole_pieces = pieces(whole.contiguous()), mine_pieces = pieces(mine);
  const auto hd = whole.size(-1);
  for (std::int64_t p = 0; p < whole_pieces.size(0); ++p) {
    // Block r of the collective's input: rank r's positions, in its shard order, zeros after them (one buffer,
    // written in place: no per-rank copies).
    auto blocks = at::empty({std::int64_t(shards_.size()), padded_, hd}, whole.options());
    for (const auto& s : shards_) {
      auto block = blocks[s.rank];
      s.for_each_block([&](const SequenceShard::Block& b, std::int64_t offset) {
        block.narrow(-2, offset, b.length()).copy_(whole_pieces[p].narrow(-2, b.start, b.length()));
      });
      if (s.length() < padded_) block.narrow(-2, s.length(), padded_ - s.length()).zero_();
    }
    const auto summed = comm_.reduce_scatter_sum(blocks).view({padded_, hd});
    mine_pieces[p].copy_(summed.narrow(-2, 0, shard().length()));
  }
  return mine;
}

void SequenceParallel::sum_over_group(at::Tensor& values) {
  std::vector<at::Tensor> one = {values};
  comm_.all_reduce_sum(one);
}

ExchangeCost exchange_cost(std::int64_t seq_len, int world, std::int64_t pieces, std::int64_t piece_position_bytes) {
  const auto padded = longest_zigzag_shard(seq_len, world);
  return {pieces, pieces * padded * piece_position_bytes, pieces * std::int64_t(world) * padded * piece_position_bytes};
}

std::map<std::string, CollectiveStats> sequence_step_collectives(const SequenceStep& s) {
  const auto exchange = exchange_cost(s.seq_len, s.world, s.pieces, s.piece_position_bytes);
  const auto gathers = s.micro_batches * s.layers * s.gathers_per_layer, scatters = s.micro_batches * s.layers;
  std::map<std::string, CollectiveStats> out;
  out["all_gather"] = {1 + gathers * exchange.calls, 8 + gathers * exchange.all_gather_bytes};
  out["reduce_scatter"] = {scatters * exchange.calls, scatters * exchange.reduce_scatter_bytes};
  if (s.statistics_bytes > 0) out["all_reduce"] = {s.micro_batches, s.micro_batches * s.statistics_bytes};
  return out;
}

}  // namespace sbp
