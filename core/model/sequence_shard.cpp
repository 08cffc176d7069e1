#include "core/model/sequence_shard.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include "core/io/input_error.h"

namespace sbp {

std::int64_t SequenceShard::length() const {
  std::int64_t n = 0;
  for (const auto& b : blocks) n += b.length();
  return n;
}

std::vector<std::int64_t> SequenceShard::positions() const {
  std::vector<std::int64_t> out;
  out.reserve(std::size_t(length()));
  for (const auto& b : blocks)
    for (auto p = b.start; p < b.end; ++p) out.push_back(p);
  return out;
}

std::int64_t SequenceShard::causal_pairs() const {
  std::int64_t n = 0;
  for (const auto& b : blocks) n += (b.start + 1 + b.end) * b.length() / 2;  // sum of p + 1 over [start, end)
  return n;
}

SequenceShard zigzag_shard(std::int64_t seq_len, int rank, int world) {
  if (world < 1 || rank < 0 || rank >= world)
    throw InputError("zigzag_shard: rank " + std::to_string(rank) + " of " + std::to_string(world));
  if (seq_len < world)  // every rank needs a position: each takes part in every layer's collectives
    throw InputError("zigzag_shard: a sequence of " + std::to_string(seq_len) + " positions over " +
                                std::to_string(world) + " ranks (each needs at least one)");
  const std::int64_t parts = 2 * std::int64_t(world);
  const auto part_start = [&](std::int64_t i) {  // the first seq_len % parts parts are one position longer
    const auto base = seq_len / parts, extra = seq_len % parts;
    return i * base + std::min(i, extra);
  };
  SequenceShard s{rank, world, seq_len, {}};
  for (const std::int64_t part : {std::int64_t(rank), parts - 1 - rank}) {
    const SequenceShard::Block b{part_start(part), part_start(part + 1)};
    if (b.length() > 0) s.blocks.push_back(b);
  }
  return s;
}

std::vector<SequenceShard> zigzag_shards(std::int64_t seq_len, int world) {
  std::vector<SequenceShard> out;
  for (int r = 0; r < world; ++r) out.push_back(zigzag_shard(seq_len, r, world));
  return out;
}

std::int64_t longest_zigzag_shard(std::int64_t seq_len, int world) {
  std::int64_t n = 0;
  for (const auto& s : zigzag_shards(seq_len, world)) n = std::max(n, s.length());
  return n;
}

std::int64_t exchange_pieces(std::int64_t slices) {
  constexpr std::int64_t kMostPieces = 4;
  const auto per_piece = (slices + kMostPieces - 1) / kMostPieces;
  return (slices + per_piece - 1) / per_piece;
}

std::int64_t slices_per_piece(std::int64_t slices) {
  const auto pieces = exchange_pieces(slices);
  return (slices + pieces - 1) / pieces;
}

}  // namespace sbp
