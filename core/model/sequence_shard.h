// Which positions of a sequence one rank of a sequence-parallel group holds (issue #32, ARCHITECTURE.md §16). The
// causal triangle is balanced by a zig-zag split: the sequence is cut into 2N parts of near-equal length (the first
// T mod 2N one position longer) and rank r holds parts r and 2N-1-r, so that a rank with early queries (few keys)
// also holds late ones (many keys). T need not divide by N or 2N (a part may be empty when T < 2N), but every rank
// needs a position: T >= N.
#pragma once

#include <cstdint>
#include <vector>

namespace sbp {

// How a group's ranks exchange the K/V of their shards (--sp-scheme; ARCHITECTURE.md §16): all-gathered (every rank
// holds a layer's whole K/V and their sums) or round a ring of key blocks (no rank holds them all). Here, below the
// memory models that size each (Workload's SequenceParallelism); parsed in core/training/sequence_scheme.h.
enum class SequenceScheme { allgather, ring };

struct SequenceShard {
  struct Block {
    std::int64_t start = 0, end = 0;  // global positions [start, end)
    std::int64_t length() const { return end - start; }
  };
  int rank = 0, world = 1;
  std::int64_t seq_len = 0;  // the whole sequence's
  std::vector<Block> blocks;  // this rank's, ascending, non-empty

  std::int64_t length() const;  // positions this rank holds
  // f(block, offset) for each block in order, `offset` its first local position (the rows before it on this rank).
  template <typename F>
  void for_each_block(F&& f) const {
    std::int64_t offset = 0;
    for (const auto& b : blocks) {
      f(b, offset);
      offset += b.length();
    }
  }
  // The global position of each local position, in order ([length()] int64 values).
  std::vector<std::int64_t> positions() const;
  // Keys x queries of the causal triangle this rank computes: sum over its positions p of p + 1.
  std::int64_t causal_pairs() const;
};

SequenceShard zigzag_shard(std::int64_t seq_len, int rank, int world);
// Every rank's shard, rank order.
std::vector<SequenceShard> zigzag_shards(std::int64_t seq_len, int world);
// The longest of them: what every rank's share of an exchange is padded to, and the most positions a rank holds.
std::int64_t longest_zigzag_shard(std::int64_t seq_len, int world);
// The pieces (one collective each) an exchange of `slices` [t, hd] slices is made of: min(slices, 4), consecutive
// slices, ceil(slices / pieces) each (core/training/sequence_parallel.h).
std::int64_t exchange_pieces(std::int64_t slices);
// The slices of a piece (the last may have fewer): what one collective's buffers are sized by.
std::int64_t slices_per_piece(std::int64_t slices);

}  // namespace sbp
