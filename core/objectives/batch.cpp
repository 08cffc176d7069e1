#include "core/objectives/batch.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include "core/io/input_error.h"

namespace sbp {
namespace {

void check(bool ok, const std::string& source, const std::string& what) {
  if (!ok) throw InputError(source + ": " + what);
}

}  // namespace

Batch Batch::to(c10::Device device) const {
  Batch out{input_ids.to(device), attention_mask.to(device), {}, packed};
  for (const auto& [name, t] : fields) out.fields[name] = t.to(device);
  return out;
}

Batch Batch::select_rows(const at::Tensor& index) const {
  const auto i = index.to(input_ids.device());
  Batch out{input_ids.index_select(0, i), attention_mask.index_select(0, i), {}, nullptr};
  at::Tensor sequences;  // packed rows: the sequences (cu_seqlens order) of the rows `index`, in that order
  if (packed) {
    const auto rows = index.to(at::kCPU, at::kLong).contiguous();
    const std::vector<std::int64_t> picked(rows.data_ptr<std::int64_t>(), rows.data_ptr<std::int64_t>() + rows.numel());
    out.packed = packed->select_rows(picked);
    std::vector<std::int64_t> first(std::size_t(packed->rows()) + 1, 0), chosen;
    for (std::int64_t r = 0; r < packed->rows(); ++r)
      first[std::size_t(r) + 1] = first[std::size_t(r)] + std::int64_t(packed->starts(r).size());
    for (const auto r : picked)
      for (auto s = first.at(std::size_t(r)); s < first[std::size_t(r) + 1]; ++s) chosen.push_back(s);
    sequences = at::tensor(chosen, at::TensorOptions().dtype(at::kLong));
  }
  for (const auto& [name, t] : fields) {
    // A packed batch's one-dimensional fields hold one value per sequence (GRPO's advantages), not per row.
    const auto& which = packed && t.dim() == 1 ? sequences : i;
    out.fields[name] = t.index_select(0, which.to(t.device()));
  }
  return out;
}

void set_sequence_boundaries(Batch& batch, const at::Tensor& position_ids, const at::Tensor& cu_seqlens,
                             const std::string& source) {
  check(batch.input_ids.defined() && batch.input_ids.dim() == 2, source, "packed rows need input_ids [B, T]");
  const auto B = batch.input_ids.size(0), T = batch.input_ids.size(1);
  std::shared_ptr<const PackedRows> from_ids, from_cu;
  if (position_ids.defined()) {
    check(position_ids.sizes() == batch.input_ids.sizes(), source,
          "position_ids " + c10::str(position_ids.sizes()) + " must have the shape of input_ids " +
              c10::str(batch.input_ids.sizes()));
    from_ids = PackedRows::from_position_ids(position_ids, source);
  }
  if (cu_seqlens.defined()) from_cu = PackedRows::from_cu_seqlens(cu_seqlens, B, T, source);
  if (from_ids && from_cu)
    for (std::int64_t b = 0; b < B; ++b)
      if (from_ids->starts(b) != from_cu->starts(b)) {
        const auto& a = from_ids->starts(b);
        const auto& c = from_cu->starts(b);
        std::size_t i = 0;
        while (i < a.size() && i < c.size() && a[i] == c[i]) ++i;
        const auto position = std::min(i < a.size() ? a[i] : T, i < c.size() ? c[i] : T);
        const bool ids_start = i < a.size() && a[i] == position;
        throw InputError(fmt::format("{}: position_ids and cu_seqlens disagree in row {} at position {}: position_ids "
                                     "{} a sequence there, cu_seqlens {}", source, b, position,
                                     ids_start ? "starts" : "continues", ids_start ? "continues one" : "starts one"));
      }
  batch.packed = from_ids ? from_ids : from_cu;
}

std::string micro_batch_rows_problem(const MicroBatchRows& micro, std::int64_t batch_rows, bool pairs) {
  std::vector<int> seen(std::size_t(std::max<std::int64_t>(batch_rows, 0)), 0);
  for (std::size_t k = 0; k < micro.size(); ++k) {
    const auto& m = micro[k];
    if (m.empty()) return fmt::format("micro_batches[{}] is empty", k);
    for (const auto r : m) {
      if (r < 0 || r >= batch_rows) return fmt::format("micro_batches[{}]: row {} of a batch of {} rows", k, r, batch_rows);
      if (seen[std::size_t(r)]++) return fmt::format("micro_batches: row {} appears twice", r);
    }
    if (pairs) {
      const auto n = m.size() / 2;
      bool paired = m.size() % 2 == 0;
      for (std::size_t i = 0; paired && i < n; ++i) paired = m[i] < batch_rows / 2 && m[n + i] == m[i] + batch_rows / 2;
      if (!paired)
        return fmt::format("micro_batches[{}]: dpo's micro-batch is its chosen rows, then their rejected rows "
                           "(row + {}) in the same order", k, batch_rows / 2);
    }
  }
  for (std::int64_t r = 0; r < batch_rows; ++r)
    if (!seen[std::size_t(r)]) return fmt::format("micro_batches: row {} is in no micro-batch", r);
  return "";
}

MicroBatchRows parse_micro_batch_rows(const std::string& text, const std::string& flag) {
  MicroBatchRows out;
  std::size_t start = 0;
  while (start <= text.size()) {
    const auto end = std::min(text.find(';', start), text.size());
    const auto part = text.substr(start, end - start);
    std::vector<std::int64_t> rows;
    std::size_t at = 0;
    while (at < part.size()) {
      const auto comma = std::min(part.find(',', at), part.size());
      const auto item = part.substr(at, comma - at);
      std::size_t used = 0;
      long long row = -1;
      try {
        row = std::stoll(item, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (item.empty() || used != item.size() || row < 0)
        throw InputError(fmt::format("{} {}: '{}' is not a row index (micro-batches separated by ';', their rows by "
                                     "',', e.g. \"0;1,2;3\")", flag, text, item));
      rows.push_back(row);
      at = comma + 1;
    }
    out.push_back(std::move(rows));
    start = end + 1;
  }
  return out;
}

const at::Tensor& Batch::field(const std::string& name) const {
  auto it = fields.find(name);
  if (it == fields.end()) throw InputError("batch has no tensor '" + name + "'");
  return it->second;
}

void validate_tokens(const Batch& b, const ModelConfig& config, const std::string& source) {
  check(b.input_ids.defined(), source, "missing tensor 'input_ids'");
  check(b.attention_mask.defined(), source, "missing tensor 'attention_mask'");
  check(b.input_ids.dim() == 2, source, "input_ids must be [B, T], got " + c10::str(b.input_ids.sizes()));
  check(b.input_ids.size(0) > 0 && b.input_ids.size(1) > 0, source, "empty batch " + c10::str(b.input_ids.sizes()));
  check(b.attention_mask.sizes() == b.input_ids.sizes(), source,
        "attention_mask " + c10::str(b.attention_mask.sizes()) + " must have the shape of input_ids " +
            c10::str(b.input_ids.sizes()));
  for (const auto& [name, t] : {std::pair{"input_ids", b.input_ids}, {"attention_mask", b.attention_mask}})
    check(t.scalar_type() == at::kLong, source, std::string(name) + " must be int64, got " + c10::toString(t.scalar_type()));
  const auto& ids = b.input_ids;
  const auto& mask = b.attention_mask;
  check(ids.min().item<std::int64_t>() >= 0 && ids.max().item<std::int64_t>() < config.vocab_size, source,
        "input_ids outside [0, vocab_size=" + std::to_string(config.vocab_size) + ")");
  check(((mask == 0) | (mask == 1)).all().item<bool>(), source, "attention_mask must hold only 0 and 1");
  // Right padding: the mask never goes 0 -> 1 along a row, and the first token is real.
  check((mask.slice(1, 1) <= mask.slice(1, 0, -1)).all().item<bool>(), source,
        "attention_mask must be right padding (1...1 0...0); left/interior padding is not supported (rows holding "
        "several sequences give position_ids or cu_seqlens instead)");
  check((mask.select(1, 0) == 1).all().item<bool>(), source, "every row needs at least one token (attention_mask[:, 0] == 1)");
  if (b.packed)
    check(b.packed->rows() == ids.size(0) && b.packed->seq_len() == ids.size(1), source,
          fmt::format("packed rows of {} x {} for input_ids {}", b.packed->rows(), b.packed->seq_len(),
                      c10::str(ids.sizes())));
}

Batch random_sft_batch(const ModelConfig& config, const RandomBatchOptions& o) {
  if (o.batch_size < 1 || o.seq_len < 2) throw InputError("random batch needs B >= 1 and T >= 2");
  if (o.pad_fraction < 0 || o.pad_fraction >= 1) throw InputError("--pad-fraction must be in [0, 1)");
  if (o.prompt_fraction < 0 || o.prompt_fraction >= 1) throw InputError("prompt fraction must be in [0, 1)");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  const auto B = o.batch_size, T = o.seq_len;
  Batch b;
  b.input_ids = at::randint(0, config.vocab_size, {B, T}, gen, at::TensorOptions().dtype(at::kLong));
  b.attention_mask = at::ones({B, T}, at::kLong);
  auto labels = b.input_ids.clone();
  for (std::int64_t r = 0; r < B; ++r) {
    auto pads = std::int64_t(std::llround(o.pad_fraction * double(T) * double(r + 1) / double(B)));
    pads = std::min(pads, T - 2);  // keep at least one predicted token per row
    const auto prompt = std::min(std::int64_t(std::llround(o.prompt_fraction * double(T - pads))), T - pads - 2);
    labels[r].slice(0, 0, prompt).fill_(-100);
    b.attention_mask[r].slice(0, T - pads).fill_(0);
    b.input_ids[r].slice(0, T - pads).fill_(0);
    labels[r].slice(0, T - pads).fill_(-100);
  }
  b.fields["labels"] = labels;
  return b;
}

Batch random_completion_batch(const ModelConfig& config, const RandomBatchOptions& o,
                              const std::vector<std::int64_t>& prompt_of_row) {
  const auto B = o.batch_size, T = o.seq_len;
  if (B < 1 || T < 2) throw InputError("random batch needs B >= 1 and T >= 2 (a prompt token and a completion token)");
  if (o.pad_fraction < 0 || o.pad_fraction >= 1) throw InputError("--pad-fraction must be in [0, 1)");
  if (o.prompt_fraction < 0 || o.prompt_fraction >= 1) throw InputError("--prompt-fraction must be in [0, 1)");
  if (std::int64_t(prompt_of_row.size()) != B) throw std::logic_error("random_completion_batch: one prompt per row");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  std::mt19937_64 rng(o.seed ^ 0x5eed5eedULL);
  auto between = [&](std::int64_t lo, std::int64_t hi) { return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng); };

  Batch b;
  b.input_ids = at::randint(0, config.vocab_size, {B, T}, gen, at::TensorOptions().dtype(at::kLong));
  b.attention_mask = at::ones({B, T}, at::kLong);
  auto completion = at::zeros({B, T}, at::kLong);
  const auto prompts = *std::max_element(prompt_of_row.begin(), prompt_of_row.end()) + 1;
  std::vector<std::int64_t> prompt_len(prompts);
  for (auto& len : prompt_len)
    len = o.prompt_fraction > 0 ? std::clamp<std::int64_t>(std::llround(o.prompt_fraction * double(T)), 1, T - 1)
                                : between(1, std::max<std::int64_t>(1, T / 2));
  std::vector<std::int64_t> first_row(prompts, -1);
  for (std::int64_t r = 0; r < B; ++r) {
    const auto p = prompt_of_row[r], P = prompt_len[p];
    if (first_row[p] < 0)
      first_row[p] = r;
    else
      b.input_ids[r].slice(0, 0, P).copy_(b.input_ids[first_row[p]].slice(0, 0, P));  // the group's shared prompt
    const auto max_pads = std::min(std::int64_t(std::floor(o.pad_fraction * double(T))), T - P - 1);
    const auto pads = max_pads > 0 ? between(0, max_pads) : 0;
    completion[r].slice(0, P, T - pads).fill_(1);
    b.attention_mask[r].slice(0, T - pads).fill_(0);
    b.input_ids[r].slice(0, T - pads).fill_(0);
  }
  b.fields["completion_mask"] = completion;
  return b;
}

}  // namespace sbp
