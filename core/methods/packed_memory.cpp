// What packed rows change in the memory and FLOP models (ARCHITECTURE.md §3 "Packed rows", §4): attention only. Every
// attention call is one sequence of one row (core/model/packed_attention.cpp cuts a chunk's queries where a sequence
// starts, row by row), so its keys are that sequence's before the call's queries, never the row's whole prefix.
#include <algorithm>
#include <utility>
#include <vector>

#include "core/methods/memory_terms.h"

namespace sbp {

std::int64_t PackedLengths::longest() const {
  std::int64_t out = 0;
  for (const auto& row : rows)
    for (const auto L : row) out = std::max(out, L);
  return out;
}

double PackedLengths::causal_pairs() const {
  double out = 0;
  for (const auto& row : rows)
    for (const auto L : row) out += double(L) * double(L + 1) / 2;
  return out;
}

namespace memory {

namespace {

// (queries, prefix) of a run: each run's backward needs more bytes with more of either, so only the runs that no other
// run exceeds in both are candidates for the largest (a few, where every run would each be a kernel probe).
using PackedRun = std::pair<std::int64_t, std::int64_t>;
std::vector<PackedRun> dominant_packed_runs(std::vector<PackedRun> runs) {
  // By queries descending, then prefix descending: a run is kept when its prefix beats every run with more queries.
  std::sort(runs.begin(), runs.end(), [](const PackedRun& a, const PackedRun& b) { return a > b; });
  std::vector<PackedRun> out;
  std::int64_t best_prefix = -1;
  for (const auto& r : runs)
    if (r.second > best_prefix) {
      out.push_back(r);
      best_prefix = r.second;
    }
  return out;
}

}  // namespace

std::int64_t packed_key_blocks_backward_bytes(const Workload& w, std::int64_t c, std::int64_t from, std::int64_t to) {
  std::vector<PackedRun> runs;
  for (const auto& row : w.packed->rows) {
    std::int64_t a = 0;  // the sequence [a, b)
    for (const auto L : row) {
      const auto b = a + L;
      // The chunks [s, s + c) in [from, to) that overlap the sequence: each reads one run of it.
      for (auto s = std::max(from, a / c * c); s < std::min(to, b); s += c) {
        const auto begin = std::max(s, a), end = std::min(s + c, b);
        runs.emplace_back(end - begin, begin - a);
      }
      a = b;
    }
  }
  std::int64_t out = 0;
  for (const auto& [queries, prefix] : dominant_packed_runs(std::move(runs)))
    out = std::max(out, key_blocks_backward_bytes(w, 1, queries, prefix));
  return out;
}

// The runs' outputs are concatenated and then transposed for o_proj, which makes a copy ([B, T, n_h*hd]) where the
// one kernel's output of a row is already in o_proj's layout (attention_activation_bytes_per_token): o_proj saves that
// copy and every run's kernel its own output.
std::int64_t packed_output_copy_bytes_per_token(const Workload& w) {
  return w.packed ? w.config.q_width() * std::int64_t(c10::elementSize(w.dtype)) : 0;
}

std::int64_t whole_sequence_attention_scratch_bytes(const Workload& w) {
  const Sizes z(w);
  if (!w.packed) return attention_scratch_bytes(w, w.dtype, z.T, z.T, true);
  const auto L = w.packed->longest();
  return attention_scratch_bytes(w, w.dtype, L, L, true, 1);
}

}  // namespace memory
}  // namespace sbp
