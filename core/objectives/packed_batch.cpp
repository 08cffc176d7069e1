#include "core/objectives/packed_batch.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "core/io/input_error.h"

namespace sbp {

Batch random_packed_sft_batch(const ModelConfig& config, const RandomBatchOptions& o) {
  if (o.batch_size < 1 || o.seq_len < 2) throw InputError("random batch needs B >= 1 and T >= 2");
  if (o.pad_fraction != 0)
    throw InputError("--pad-fraction with --pack: a packed row is filled with sequences, its last one cut to fit");
  return packed_sft_batch(config, o.pack.draw(o.batch_size, o.seq_len, o.seed), o.prompt_fraction, o.seed);
}

Batch packed_sft_batch(const ModelConfig& config, const std::vector<std::vector<std::int64_t>>& lengths,
                       double prompt_fraction, std::uint64_t seed) {
  if (prompt_fraction < 0 || prompt_fraction >= 1) throw InputError("prompt fraction must be in [0, 1)");
  std::int64_t T = 0;
  for (const auto L : lengths.at(0)) T += L;
  const auto B = std::int64_t(lengths.size());
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Batch b;
  b.input_ids = at::randint(0, config.vocab_size, {B, T}, gen, at::TensorOptions().dtype(at::kLong));
  b.attention_mask = at::ones({B, T}, at::kLong);
  b.packed = PackedRows::from_lengths(lengths, T);  // checks that every row's lengths sum to T
  auto labels = b.input_ids.clone();
  for (std::int64_t r = 0; r < B; ++r) {
    std::int64_t start = 0;
    for (const auto L : lengths[std::size_t(r)]) {
      const auto prompt = std::clamp<std::int64_t>(std::llround(prompt_fraction * double(L)), 1, L);
      labels[r].slice(0, start, start + prompt).fill_(-100);
      start += L;
    }
  }
  b.fields["labels"] = labels;
  return b;
}

Batch padded_sequences(const Batch& packed) {
  if (!packed.packed) return packed;
  const auto& rows = *packed.packed;
  std::int64_t longest = 0;
  for (std::int64_t r = 0; r < rows.rows(); ++r)
    for (const auto s : rows.starts(r)) longest = std::max(longest, rows.sequence_end(r, s) - s);
  const auto n = rows.sequences();
  const auto padded = [&](const at::Tensor& t, std::int64_t pad) {
    if (t.dim() != 2 || t.size(0) != rows.rows() || t.size(1) != rows.seq_len())
      throw std::logic_error("padded_sequences: a field that is not per position ([B, T]) has no per-sequence rows");
    auto out = at::full({n, longest}, pad, t.options());
    std::int64_t i = 0;
    for (std::int64_t r = 0; r < rows.rows(); ++r)
      for (const auto s : rows.starts(r)) {
        const auto L = rows.sequence_end(r, s) - s;
        out[i++].slice(0, 0, L).copy_(t[r].slice(0, s, s + L));
      }
    return out;
  };
  Batch out;
  out.input_ids = padded(packed.input_ids, 0);
  // Pads of a packed row (a right-padded tail) stay pads; the rest of each sequence is its tokens.
  out.attention_mask = padded(packed.attention_mask, 0);
  for (const auto& [name, t] : packed.fields)  // one value per sequence (GRPO's advantages): sequence i is row i
    out.fields[name] = t.dim() == 1 && t.size(0) == n ? t : padded(t, name == "labels" ? -100 : 0);
  return out;
}

}  // namespace sbp
