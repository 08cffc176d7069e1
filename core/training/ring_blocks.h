// Which keys of a block travelling round the ring the queries of a chunk see (ARCHITECTURE.md §16 "Packed rows"):
// the causal rule and, on packed rows, each query's own sequence, wherever that sequence's earlier positions live (a
// sequence may straddle ranks, and a rank may hold the tails of several). Every rank holds the whole batch's
// boundaries (global positions), so what a rank needs of each block is known before any block arrives: a part of a
// block that no query of a chunk's row can see is skipped, never attended under a mask, and counted.
#pragma once

#include <cstdint>
#include <vector>

#include "core/model/kv_source.h"
#include "core/model/sequence_shard.h"

namespace sbp {

class PackedRows;  // core/model/packed_rows.h

// Queries of a chunk that see the same keys: rows [row, row + rows) (every row at once when the rows are not packed),
// the chunk's queries [offset, offset + length) at global positions [begin, begin + length), all in one sequence that
// starts at sequence_start (0 when not packed).
struct QueryRun {
  std::int64_t row = 0, rows = 1, offset = 0, length = 0, begin = 0, sequence_start = 0;
  std::int64_t end() const { return begin + length; }
};
// A chunk's runs, row after row and in order within a row: on packed rows cut where a sequence starts
// (PackedRows::runs); otherwise one run of all `batch_rows` rows.
std::vector<QueryRun> query_runs(const ChunkRows& chunk, std::int64_t batch_rows, const PackedRows* packed);

// Keys a run sees in one part of a block: [offset, offset + length) of its owner's rows (shard order), all visible,
// or `causal`: the run's own positions under the causal rule (a square block, in the rank's own shard only).
struct KeyRange {
  std::int64_t offset = 0, length = 0;
  bool causal = false;
};
// The keys of `part` (one block of a shard, at `part_offset` in its owner's rows) that `run` sees: those from its
// sequence's start to before its first query in full, then its own positions causally; nothing after them. At most
// two ranges. A part that holds some of the run's queries holds all of them (a chunk never crosses one of its
// shard's blocks; logic_error otherwise).
std::vector<KeyRange> visible_keys(const SequenceShard::Block& part, std::int64_t part_offset, const QueryRun& run);

// What a rank's ring passes did with the key blocks, one count per (query chunk, row, part of a travelling shard) and
// pass (a forward merge, a backward): computed, or skipped because every key of the part comes after every query of
// the chunk (the causal rule), or lies before the start of the sequence of the row's earliest query in the chunk
// (packed rows: keys of sequences no query of the chunk belongs to). An analytic fact of the layout, not a timing.
struct RingBlockCounts {
  std::int64_t computed = 0, after_queries = 0, before_sequences = 0;
  std::int64_t skipped() const { return after_queries + before_sequences; }
  bool operator==(const RingBlockCounts&) const = default;
};

// f(j, range) for every range of `owner`'s parts that run j of `runs` (one chunk's, query_runs) sees, part by part;
// each (row, part) counted into `counts` once.
template <typename F>
void for_each_visible_range(const SequenceShard& owner, const ChunkRows& chunk, const std::vector<QueryRun>& runs,
                            RingBlockCounts& counts, F&& f) {
  owner.for_each_block([&](const SequenceShard::Block& part, std::int64_t part_offset) {
    for (std::size_t j = 0; j < runs.size();) {  // one row (or every row at once) at a time
      bool seen = false;
      auto k = j;
      for (; k < runs.size() && runs[k].row == runs[j].row; ++k)
        for (const auto& range : visible_keys(part, part_offset, runs[k])) {
          f(k, range);
          seen = true;
        }
      auto& count = seen ? counts.computed
                         : part.start >= chunk.position + chunk.length() ? counts.after_queries : counts.before_sequences;
      count += runs[j].rows;
      j = k;
    }
  });
}

}  // namespace sbp
