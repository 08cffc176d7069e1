// A training batch in HF's convention (right padding, or several sequences packed per row), plus what its objective
// reads beside the tokens.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/model/config.h"
#include "core/model/packed_rows.h"
#include "core/objectives/length_distribution.h"
#include "core/io/input_error.h"

namespace sbp {

struct Batch {
  at::Tensor input_ids;       // [B, T] int64
  at::Tensor attention_mask;  // [B, T] int64, 1 = token, 0 = right padding
  // The objective's tensors, by their batch-file names: SFT "labels"; GRPO "completion_mask", "advantages",
  // "old_logps", "ref_logps"; DPO "completion_mask", "ref_logps". Each objective validates its own (objective.h).
  // Packed rows: a [n] field holds one value per sequence in cu_seqlens order (GRPO's advantages).
  std::map<std::string, at::Tensor> fields;
  // Null: one sequence per row. Otherwise the sequences of each row (HF's position_ids, flash-attention's cu_seqlens;
  // set_sequence_boundaries), each attending within itself only (ARCHITECTURE.md §3 "Packed rows").
  std::shared_ptr<const PackedRows> packed;

  std::int64_t batch_size() const { return input_ids.size(0); }
  std::int64_t seq_len() const { return input_ids.size(1); }
  bool has(const std::string& name) const { return fields.count(name) != 0; }
  const at::Tensor& field(const std::string& name) const;  // Throws InputError naming it
  Batch to(c10::Device device) const;  // every tensor moved
  // Rows `index` (int64 [n]) of every tensor (each has the rows first): a micro-batch or a rank's share. Of packed rows,
  // a one-dimensional field has one value per sequence (GRPO's advantages, cu_seqlens order): the rows' sequences'.
  Batch select_rows(const at::Tensor& index) const;
};

// The tokens only: input_ids in the vocabulary, attention_mask of right padding with a real first token, packed rows
// of the batch's shape. Throws InputError saying what is wrong and where (`source` names the file or flag). With
// right padding and no loss on pads the causal rule alone gives HF's gradients, so no method ever needs a [B, T, T]
// mask (ARCHITECTURE.md §4); left/interior padding is rejected (packed rows say where sequences start instead).
void validate_tokens(const Batch& batch, const ModelConfig& config, const std::string& source);

// Packs `batch` by the boundaries given in either spelling, or both (each undefined when absent): position_ids
// [B, T] and cu_seqlens [n + 1] over the flattened B*T tokens (packed_rows.h). Derived once here, the one from the
// other; both given must describe the same sequences. Throws InputError naming `source`, the row and the position.
void set_sequence_boundaries(Batch& batch, const at::Tensor& position_ids, const at::Tensor& cu_seqlens,
                             const std::string& source);

// The micro-batches of one optimizer step by rows: rows[k] the batch rows micro-batch k holds.
using MicroBatchRows = std::vector<std::vector<std::int64_t>>;
// What is wrong with `micro` as a step's micro-batches of a batch of `batch_rows` rows (empty: nothing): every row in
// exactly one non-empty micro-batch; with `pairs` (DPO: P chosen rows, then their P rejected ones) each micro-batch
// is its chosen rows, then their rejected rows (row + P) in the same order, so that no pair is cut.
std::string micro_batch_rows_problem(const MicroBatchRows& micro, std::int64_t batch_rows, bool pairs);
// "0;1,2;3": micro-batches separated by ';', each its rows separated by ','. Throws InputError naming `flag`.
MicroBatchRows parse_micro_batch_rows(const std::string& text, const std::string& flag);

struct RandomBatchOptions {
  std::int64_t batch_size = 1, seq_len = 128;
  double pad_fraction = 0.0;     // SFT: row b gets round(F*T*(b+1)/B) pads; GRPO/DPO: each row up to F*T, drawn
  double prompt_fraction = 0.0;  // SFT: leading labels set to -100; GRPO/DPO: prompt length (0: drawn in [1, T/2])
  std::uint64_t seed = 0;
  std::int64_t group = 0;        // GRPO: completions per prompt (0: the whole batch is one group)
  LengthDistribution pack;       // SFT: rows packed with sequences of these lengths (none: one sequence per row)
};

// SFT: random tokens, labels = input_ids with -100 on the prompt and on pads.
Batch random_sft_batch(const ModelConfig& config, const RandomBatchOptions& options);

// Prompt + completion rows for GRPO and DPO: rows with the same prompt_of_row[r] share a prompt (tokens and seeded
// length); each row's completion fills the rest of the row but for a seeded number of right pads (at least one
// completion token stays). Fields: completion_mask [B, T] (1 on completion tokens).
Batch random_completion_batch(const ModelConfig& config, const RandomBatchOptions& options,
                              const std::vector<std::int64_t>& prompt_of_row);

}  // namespace sbp
