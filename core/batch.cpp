#include "core/batch.h"

#include <cmath>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

namespace sbp {
namespace {

void check(bool ok, const std::string& source, const std::string& what) {
  if (!ok) throw std::invalid_argument(source + ": " + what);
}

}  // namespace

void validate_batch(const Batch& b, const ModelConfig& config, const std::string& source) {
  for (const auto* t : {&b.input_ids, &b.labels, &b.attention_mask}) check(t->defined(), source, "batch tensor missing");
  check(b.input_ids.dim() == 2, source, "input_ids must be [B, T], got " + c10::str(b.input_ids.sizes()));
  check(b.input_ids.size(0) > 0 && b.input_ids.size(1) > 0, source, "empty batch " + c10::str(b.input_ids.sizes()));
  check(b.labels.sizes() == b.input_ids.sizes(), source,
        "labels " + c10::str(b.labels.sizes()) + " must have the shape of input_ids " + c10::str(b.input_ids.sizes()));
  check(b.attention_mask.sizes() == b.input_ids.sizes(), source,
        "attention_mask " + c10::str(b.attention_mask.sizes()) + " must have the shape of input_ids");
  for (const auto& [name, t] : {std::pair{"input_ids", b.input_ids}, {"labels", b.labels}, {"attention_mask", b.attention_mask}})
    check(t.scalar_type() == at::kLong, source, std::string(name) + " must be int64, got " + c10::toString(t.scalar_type()));
  const auto ids = b.input_ids, mask = b.attention_mask, labels = b.labels;
  check(ids.min().item<std::int64_t>() >= 0 && ids.max().item<std::int64_t>() < config.vocab_size, source,
        "input_ids outside [0, vocab_size=" + std::to_string(config.vocab_size) + ")");
  check(((mask == 0) | (mask == 1)).all().item<bool>(), source, "attention_mask must hold only 0 and 1");
  // Right padding: the mask never goes 0 -> 1 along a row, and the first token is real.
  check((mask.slice(1, 1) <= mask.slice(1, 0, -1)).all().item<bool>(), source,
        "attention_mask must be right padding (1...1 0...0); left/interior padding and packed sequences are not supported");
  check((mask.select(1, 0) == 1).all().item<bool>(), source, "every row needs at least one token (attention_mask[:, 0] == 1)");
  check(((mask == 1) | (labels == -100)).all().item<bool>(), source, "labels on padded positions must be -100");
  const auto valid = labels != -100;
  check((labels.masked_select(valid) >= 0).all().item<bool>() &&
            (labels.masked_select(valid) < config.vocab_size).all().item<bool>(),
        source, "labels must be -100 or in [0, vocab_size=" + std::to_string(config.vocab_size) + ")");
}

Batch random_batch(const ModelConfig& config, const RandomBatchOptions& o) {
  if (o.batch_size < 1 || o.seq_len < 2) throw std::invalid_argument("random batch needs B >= 1 and T >= 2");
  if (o.pad_fraction < 0 || o.pad_fraction >= 1) throw std::invalid_argument("--pad-fraction must be in [0, 1)");
  if (o.prompt_fraction < 0 || o.prompt_fraction >= 1) throw std::invalid_argument("prompt fraction must be in [0, 1)");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  const auto B = o.batch_size, T = o.seq_len;
  Batch b;
  b.input_ids = at::randint(0, config.vocab_size, {B, T}, gen, at::TensorOptions().dtype(at::kLong));
  b.attention_mask = at::ones({B, T}, at::kLong);
  b.labels = b.input_ids.clone();
  for (std::int64_t r = 0; r < B; ++r) {
    auto pads = std::int64_t(std::llround(o.pad_fraction * double(T) * double(r + 1) / double(B)));
    pads = std::min(pads, T - 2);  // keep at least one predicted token per row
    const auto prompt = std::min(std::int64_t(std::llround(o.prompt_fraction * double(T - pads))), T - pads - 2);
    b.labels[r].slice(0, 0, prompt).fill_(-100);
    b.attention_mask[r].slice(0, T - pads).fill_(0);
    b.input_ids[r].slice(0, T - pads).fill_(0);
    b.labels[r].slice(0, T - pads).fill_(-100);
  }
  return b;
}

}  // namespace sbp
