// Rows that hold several sequences each (ARCHITECTURE.md §3 "Packed rows"): the layout long-context fine-tuning feeds
// instead of padded rows. Two spellings of the same boundaries arrive from outside:
//  - position_ids [B, T], as transformers' DataCollatorWithFlattening writes them: 0 at each sequence's first token,
//    then 1, 2, ... (RoPE rotates each sequence from 0);
//  - cu_seqlens [n + 1], as flash-attention's varlen kernels take them: the cumulative sequence lengths over the
//    batch's B*T tokens flattened row after row (HF's cu_seq_lens_q).
// One object holds both, derived from either once and checked there. The model asks it two things: the RoPE position
// of each column, and where the sequences of a run of queries start (each sequence attends causally within itself).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace sbp {

class PackedRows {
 public:
  // starts[b]: the first position of each sequence of row b, ascending from 0, each < seq_len (logic_error
  // otherwise: the factories below check what a user gives).
  PackedRows(std::vector<std::vector<std::int64_t>> starts, std::int64_t seq_len);
  PackedRows(const PackedRows&) = default;
  virtual ~PackedRows() = default;

  // Throw InputError naming `source`, the row and the position: a row that does not start at 0, a position that is
  // neither 0 (a new sequence) nor the one before it plus 1.
  static std::shared_ptr<const PackedRows> from_position_ids(const at::Tensor& position_ids, const std::string& source);
  // cu_seqlens over B rows of T: from 0 to B*T, strictly increasing (a repeated value is an empty sequence), every
  // row's start among them (a sequence never runs past its row's end). Throws InputError naming the entry, the row
  // and the position.
  static std::shared_ptr<const PackedRows> from_cu_seqlens(const at::Tensor& cu_seqlens, std::int64_t rows,
                                                           std::int64_t seq_len, const std::string& source);
  // Each row's sequence lengths, summing to seq_len (a random packed batch).
  static std::shared_ptr<const PackedRows> from_lengths(const std::vector<std::vector<std::int64_t>>& lengths,
                                                        std::int64_t seq_len);

  std::int64_t rows() const { return std::int64_t(starts_.size()); }
  std::int64_t seq_len() const { return seq_len_; }
  const std::vector<std::int64_t>& starts(std::int64_t row) const { return starts_.at(std::size_t(row)); }
  std::int64_t sequences() const;  // over every row
  // The sequence of row `row` holding `position`: its start, and its end (the next start, or T).
  std::int64_t sequence_start(std::int64_t row, std::int64_t position) const;
  std::int64_t sequence_end(std::int64_t row, std::int64_t position) const;
  // The two spellings: position_ids [B, T] int64; cu_seqlens [n + 1] int32 over the flattened B*T tokens.
  const at::Tensor& position_ids() const { return position_ids_; }
  at::Tensor cu_seqlens() const;
  // The rows `index` in that order (a micro-batch, a rank's share).
  std::shared_ptr<const PackedRows> select_rows(const std::vector<std::int64_t>& index) const;

  // RoPE's positions of columns [s, e) of every row: [B, e - s] int64 on the CPU, counting from each sequence's start.
  virtual at::Tensor positions(std::int64_t s, std::int64_t e) const;
  // Queries [s, e) of row `row` cut where a sequence starts, in order: [begin, end) inside one sequence, which starts
  // at sequence_start (the first run's may lie before s; every later run starts its sequence: begin == sequence_start).
  struct Run {
    std::int64_t begin, end, sequence_start;
  };
  virtual std::vector<Run> runs(std::int64_t row, std::int64_t s, std::int64_t e) const;

 private:
  std::vector<std::vector<std::int64_t>> starts_;
  std::int64_t seq_len_;
  at::Tensor position_ids_;  // [B, T] int64, CPU
};

}  // namespace sbp
