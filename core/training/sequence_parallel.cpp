#include "core/training/sequence_parallel.h"

#include <algorithm>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "core/io/input_error.h"
#include "core/training/ring_exchange.h"

namespace sbp {

namespace {

std::int64_t longest(const std::vector<SequenceShard>& shards) {
  std::int64_t n = 0;
  for (const auto& s : shards) n = std::max(n, s.length());
  return n;
}

// [..., t, hd] as [S, t, hd] (a view): its slices, grouped into the exchange's pieces (exchange_pieces).
at::Tensor slices(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 2 && x.is_contiguous(), "SequenceParallel: a contiguous [..., t, hd] tensor");
  return x.view({-1, x.size(-2), x.size(-1)});
}

// f(first, count) for each piece: consecutive slices, ceil(S / pieces) each (the last may have fewer).
template <typename F>
void for_each_piece(std::int64_t slices, F&& f) {
  const auto per_piece = slices_per_piece(slices);
  for (std::int64_t first = 0; first < slices; first += per_piece) f(first, std::min(per_piece, slices - first));
}

}  // namespace

at::Tensor pad_positions(const at::Tensor& x, std::int64_t padded) {
  const auto t = x.size(-2);
  if (t == padded) return x.contiguous();
  auto sizes = x.sizes().vec();
  sizes[sizes.size() - 2] = padded;
  auto out = at::zeros(sizes, x.options());
  out.narrow(-2, 0, t).copy_(x);
  return out;
}

SequenceScheme parse_sequence_scheme(const std::string& name) {
  if (name == "allgather") return SequenceScheme::allgather;
  if (name == "ring") return SequenceScheme::ring;
  throw InputError("--sp-scheme " + name + ": allgather or ring");
}

const char* sequence_scheme_name(SequenceScheme scheme) {
  return scheme == SequenceScheme::ring ? "ring" : "allgather";
}

std::unique_ptr<KVSource> make_sequence_exchange(SequenceScheme scheme, Communicator& group, std::int64_t seq_len) {
  if (scheme == SequenceScheme::ring) return std::make_unique<RingExchange>(group, seq_len);
  return std::make_unique<SequenceParallel>(group, seq_len);
}

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
  const auto local_slices = slices(local.contiguous()), whole_slices = slices(whole);
  for_each_piece(local_slices.size(0), [&](std::int64_t first, std::int64_t count) {
    const auto all = comm_.all_gather(pad_positions(local_slices.narrow(0, first, count), padded_));  // [N, n, t, hd]
    const auto piece = whole_slices.narrow(0, first, count);
    // Every rank's blocks copied to their global positions: together they tile [0, T).
    for (const auto& s : shards_)
      s.for_each_block([&](const SequenceShard::Block& b, std::int64_t offset) {
        piece.narrow(-2, b.start, b.length()).copy_(all[s.rank].narrow(-2, offset, b.length()));
      });
  });
  return whole;
}

at::Tensor SequenceParallel::scatter_sum(const at::Tensor& whole) {
  TORCH_CHECK(whole.size(-2) == shard().seq_len, "SequenceParallel::scatter_sum: ", whole.size(-2),
              " positions for a sequence of ", shard().seq_len);
  auto sizes = whole.sizes().vec();
  sizes[sizes.size() - 2] = shard().length();
  auto mine = at::empty(sizes, whole.options());
  const auto whole_slices = slices(whole.contiguous()), mine_slices = slices(mine);
  const auto hd = whole.size(-1);
  for_each_piece(whole_slices.size(0), [&](std::int64_t first, std::int64_t count) {
    const auto piece = whole_slices.narrow(0, first, count);
    // Block r of the collective's input: rank r's positions, in its shard order, zeros after them (one buffer,
    // written in place: no per-rank copies).
    auto blocks = at::empty({std::int64_t(shards_.size()), count, padded_, hd}, whole.options());
    for (const auto& s : shards_) {
      auto block = blocks[s.rank];
      s.for_each_block([&](const SequenceShard::Block& b, std::int64_t offset) {
        block.narrow(-2, offset, b.length()).copy_(piece.narrow(-2, b.start, b.length()));
      });
      if (s.length() < padded_) block.narrow(-2, s.length(), padded_ - s.length()).zero_();
    }
    const auto summed = comm_.reduce_scatter_sum(blocks).view({count, padded_, hd});
    mine_slices.narrow(0, first, count).copy_(summed.narrow(-2, 0, shard().length()));
  });
  return mine;
}

void SequenceParallel::sum_over_group(at::Tensor& values) {
  std::vector<at::Tensor> one = {values};
  comm_.all_reduce_sum(one);
}

ExchangeCost exchange_cost(std::int64_t seq_len, int world, std::int64_t slices, std::int64_t slice_position_bytes) {
  const auto padded = longest_zigzag_shard(seq_len, world);
  return {exchange_pieces(slices), slices * padded * slice_position_bytes,
          slices * std::int64_t(world) * padded * slice_position_bytes};
}

std::int64_t ring_hops_per_layer(int world, int forward_passes) {
  return std::int64_t(forward_passes + 1) * (world - 1) + world;
}

std::map<std::string, CollectiveStats> sequence_step_collectives(const SequenceStep& s) {
  const auto exchange = exchange_cost(s.seq_len, s.world, s.slices, s.slice_position_bytes);
  const auto gathers = s.micro_batches * s.layers * s.gathers_per_layer, scatters = s.micro_batches * s.layers;
  std::map<std::string, CollectiveStats> out;
  if (s.scheme == SequenceScheme::ring) {
    const auto padded = longest_zigzag_shard(s.seq_len, s.world);
    const auto block = s.slices * padded * s.slice_position_bytes;
    const auto sums = s.slices * padded * (s.sum_position_bytes > 0 ? s.sum_position_bytes : s.slice_position_bytes);
    const auto layers = s.micro_batches * s.layers, N = std::int64_t(s.world);
    out["all_gather"] = {1, 8};
    out["ring_shift"] = {layers * ring_hops_per_layer(s.world, s.gathers_per_layer),
                         layers * ((s.gathers_per_layer + 1) * (N - 1) * block + N * sums)};
  } else {
    out["all_gather"] = {1 + gathers * exchange.calls, 8 + gathers * exchange.all_gather_bytes};
    out["reduce_scatter"] = {scatters * exchange.calls, scatters * exchange.reduce_scatter_bytes};
  }
  if (s.statistics_bytes > 0) out["all_reduce"] = {s.micro_batches, s.micro_batches * s.statistics_bytes};
  return out;
}

}  // namespace sbp
