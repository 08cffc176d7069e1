#include "core/training/ring_blocks.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "core/model/packed_rows.h"

namespace sbp {

std::vector<QueryRun> query_runs(const ChunkRows& chunk, std::int64_t batch_rows, const PackedRows* packed) {
  const auto p = chunk.position, e = p + chunk.length();
  if (!packed) return {{0, batch_rows, 0, chunk.length(), p, 0}};
  if (packed->rows() != batch_rows || e > packed->seq_len())
    throw std::logic_error("ring attention: queries of " + std::to_string(batch_rows) + " rows up to position " +
                           std::to_string(e) + " for packed rows of " + std::to_string(packed->rows()) + " x " +
                           std::to_string(packed->seq_len()));
  std::vector<QueryRun> out;
  for (std::int64_t b = 0; b < batch_rows; ++b)
    for (const auto& r : packed->runs(b, p, e)) out.push_back({b, 1, r.begin - p, r.end - r.begin, r.begin, r.sequence_start});
  return out;
}

std::vector<KeyRange> visible_keys(const SequenceShard::Block& part, std::int64_t part_offset, const QueryRun& run) {
  std::vector<KeyRange> out;
  if (part.start >= run.end()) return out;  // every key after every query
  // Keys before the run's first query, from its sequence's start: all visible.
  const auto from = std::max(part.start, run.sequence_start), to = std::min(part.end, run.begin);
  if (from < to) out.push_back({part_offset + from - part.start, to - from, false});
  if (part.end > run.begin) {  // the part holds the run's queries: their own keys, causally
    if (part.start > run.begin || run.end() > part.end)
      throw std::logic_error("ring attention: queries [" + std::to_string(run.begin) + ", " + std::to_string(run.end()) +
                             ") cross the key block [" + std::to_string(part.start) + ", " + std::to_string(part.end) +
                             ")");
    out.push_back({part_offset + run.begin - part.start, run.length, true});
  }
  return out;
}

}  // namespace sbp
