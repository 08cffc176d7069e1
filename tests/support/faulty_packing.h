// Faulty packings for the negative controls of the packed-rows gate (ARCHITECTURE.md §8): each one gets one thing of a
// packed row wrong in a way packing code is known to, so that the tests can show the gate fails on it. The production
// classes (PackedRows, SftObjective) carry no switch for any of them.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/model/packed_rows.h"
#include "core/objectives/sft.h"

namespace sbp::test {

// Attention across one boundary: the sequence starting at `boundary` of row `row` also sees the one before it (as
// a mask built from attention_mask alone lets it), while RoPE still restarts there.
class LeakyBoundaryRows : public PackedRows {
 public:
  LeakyBoundaryRows(const PackedRows& rows, std::int64_t row, std::int64_t boundary)
      : PackedRows(rows), row_(row), boundary_(boundary) {}
  std::vector<Run> runs(std::int64_t row, std::int64_t s, std::int64_t e) const override;

 private:
  std::int64_t row_, boundary_;
};

// Positions not restarted: RoPE rotates every column at its place in the row (0..T-1), while attention stays within
// each sequence.
class UnrestartedPositionRows : public PackedRows {
 public:
  explicit UnrestartedPositionRows(const PackedRows& rows) : PackedRows(rows) {}
  at::Tensor positions(std::int64_t s, std::int64_t e) const override;
};

// Positions restarted where a rank's shard begins (sequence parallelism): a rank that numbers a sequence begun on an
// earlier rank's block from its own first position, as one that builds its position_ids from its shard alone would.
// `block_starts`: the global first positions of the rank's blocks.
class LocalRestartRows : public PackedRows {
 public:
  LocalRestartRows(const PackedRows& rows, std::vector<std::int64_t> block_starts)
      : PackedRows(rows), block_starts_(std::move(block_starts)) {}
  at::Tensor positions(std::int64_t s, std::int64_t e) const override;

 private:
  std::vector<std::int64_t> block_starts_;
};

// One separator label kept: the last position of row 0's first sequence is scored on the next sequence's first
// token (a collator that forgot the -100 there); the normaliser stays the batch's count without it.
class SeparatorKeepingSft : public SftObjective {
 public:
  using SftObjective::SftObjective;

 protected:
  Fields prepare_fields(const Batch& batch, const ModelConfig& config, const std::optional<StepTotals>& step_totals,
                        const std::string& source) const override;
};

}  // namespace sbp::test
