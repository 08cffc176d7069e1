// Packed batches made here: random ones for the drivers (`run --pack`), and the first oracle of every packed step,
// the same sequences given as right-padded rows (ARCHITECTURE.md §8).
#pragma once

#include "core/objectives/batch.h"

namespace sbp {

// SFT, B rows of T positions filled with sequences of options.pack's lengths (seeded): random tokens, labels =
// input_ids with -100 at each sequence's first token (DataCollatorWithFlattening's separator: no sequence is
// predicted from the one before it) and on its prompt (the leading prompt_fraction of its labels). Rows are full: no
// padding (Throws InputError for a pad_fraction).
Batch random_packed_sft_batch(const ModelConfig& config, const RandomBatchOptions& options);
// The same with each row's sequence lengths given (summing to T): random tokens of `seed`.
Batch packed_sft_batch(const ModelConfig& config, const std::vector<std::vector<std::int64_t>>& lengths,
                       double prompt_fraction, std::uint64_t seed);

// The sequences of a packed batch as right-padded rows, one sequence a row in order (row-major over the packed rows),
// each padded to the longest: input_ids 0, attention_mask 0 and labels -100 on pads; every other per-position field
// ([B, T]) 0 on pads; a per-sequence field ([n], GRPO's advantages) as it is, sequence i being row i. A batch that is
// not packed comes back as it is. Any other field: std::logic_error.
Batch padded_sequences(const Batch& packed);

}  // namespace sbp
