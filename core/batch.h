// A training batch in HF's convention: right padding, labels -100 where no loss is taken.
#pragma once

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

#include "core/config.h"

namespace sbp {

struct Batch {
  at::Tensor input_ids;       // [B, T] int64
  at::Tensor labels;          // [B, T] int64, -100 = ignored; shifted inside the objective (t predicts t+1)
  at::Tensor attention_mask;  // [B, T] int64, 1 = token, 0 = right padding
  std::int64_t batch_size() const { return input_ids.size(0); }
  std::int64_t seq_len() const { return input_ids.size(1); }
};

// Throws std::invalid_argument saying what is wrong and where (`source` names the file or flag). Rejects left or
// interior padding and labels on padded positions: with right padding and no loss on pads, the causal rule alone
// gives HF's gradients, so no method ever needs a [B, T, T] mask (DESIGN §4).
void validate_batch(const Batch& batch, const ModelConfig& config, const std::string& source);

struct RandomBatchOptions {
  std::int64_t batch_size = 1, seq_len = 128;
  double pad_fraction = 0.0;     // row b gets round(pad_fraction*T*(b+1)/B) pads: ragged, the last row the most
  double prompt_fraction = 0.0;  // leading tokens of each row whose labels are -100 (prompt masking)
  std::uint64_t seed = 0;
};
Batch random_batch(const ModelConfig& config, const RandomBatchOptions& options);

}  // namespace sbp
