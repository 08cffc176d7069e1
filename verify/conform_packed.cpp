#include "verify/conform_packed.h"

#include <algorithm>
#include <numeric>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/io/input_error.h"
#include "core/objectives/grpo.h"
#include "core/objectives/objective.h"
#include "core/objectives/packed_batch.h"

namespace sbp {

namespace {

std::int64_t row_sum(const std::vector<std::int64_t>& row) { return std::accumulate(row.begin(), row.end(), std::int64_t(0)); }

bool is_grpo(const ConformCase& c) { return c.objective.rfind("grpo", 0) == 0; }

}  // namespace

ConformCase packed_case(ConformCase c, std::vector<std::vector<std::int64_t>> lengths) {
  c.batch.batch_size = std::int64_t(lengths.size());
  c.batch.pad_fraction = 0;  // a packed row's padding is what its lengths leave of T
  c.pack_lengths = std::move(lengths);
  return c;
}

std::string pack_lengths_problem(const ConformCase& c) {
  if (c.pack_lengths.empty()) return "";
  if (c.objective.rfind("sft", 0) != 0 && !is_grpo(c))
    return "pack_lengths: packed rows are SFT or GRPO (DPO refuses packed rows: its pairs would have to be matched "
           "across packs)";
  if (std::int64_t(c.pack_lengths.size()) != c.batch.batch_size)
    return fmt::format("pack_lengths: {} rows for a batch of {}", c.pack_lengths.size(), c.batch.batch_size);
  for (std::size_t r = 0; r < c.pack_lengths.size(); ++r) {
    const auto& row = c.pack_lengths[r];
    if (row.empty()) return fmt::format("pack_lengths[{}]: a row needs at least one sequence", r);
    for (std::size_t i = 0; i < row.size(); ++i)
      if (row[i] < 1) return fmt::format("pack_lengths[{}][{}]: length {}, a sequence needs at least 1", r, i, row[i]);
    if (row_sum(row) > c.batch.seq_len)
      return fmt::format("pack_lengths[{}]: {} tokens do not fit T = {}", r, row_sum(row), c.batch.seq_len);
    // verl's remove-padding layout has no padding; a padding segment would be a completion of its own with an
    // advantage, counted by grpo's mean and dr_grpo's count of sequences.
    if (is_grpo(c) && row_sum(row) != c.batch.seq_len)
      return fmt::format("pack_lengths[{}]: {} tokens for T = {}: a packed GRPO row is full (its padding would be a "
                         "sequence of its own)", r, row_sum(row), c.batch.seq_len);
  }
  return "";
}

Batch conform_batch(const ConformCase& c, const Objective& objective) {
  if (c.pack_lengths.empty()) return objective.random_batch(c.config, c.batch);
  if (const auto problem = pack_lengths_problem(c); !problem.empty()) throw InputError(c.name + ": " + problem);
  if (is_grpo(c))  // rows full (pack_lengths_problem): every segment a completion with its own advantage
    return packed_grpo_batch(c.config, c.pack_lengths, c.batch.group, c.batch.seed, c.batch.prompt_fraction);
  const auto T = c.batch.seq_len;
  // The padding of a short row as a segment of its own: the collator's own sequences keep their lengths.
  auto segments = c.pack_lengths;
  for (auto& row : segments)
    if (const auto used = row_sum(row); used < T) row.push_back(T - used);
  auto batch = packed_sft_batch(c.config, segments, c.batch.prompt_fraction, c.batch.seed);
  auto& labels = batch.fields.at("labels");
  for (std::size_t r = 0; r < c.pack_lengths.size(); ++r) {
    const auto used = row_sum(c.pack_lengths[r]);
    if (used == T) continue;
    batch.input_ids[std::int64_t(r)].slice(0, used).fill_(0);
    batch.attention_mask[std::int64_t(r)].slice(0, used).fill_(0);
    labels[std::int64_t(r)].slice(0, used).fill_(-100);
  }
  return batch;
}

void add_packed_case_json(const ConformCase& c, nlohmann::json& out) {
  if (c.pack_lengths.empty()) return;
  std::int64_t longest = 0;
  for (const auto& row : c.pack_lengths) {
    for (const auto L : row) longest = std::max(longest, L);
    longest = std::max(longest, c.batch.seq_len - row_sum(row));  // the padding's segment
  }
  out["packed"] = true;
  out["sequences"] = c.pack_lengths;
  out["max_length"] = longest;
  if (is_grpo(c)) out["per_sequence"] = nlohmann::json::array({"advantages"});
}

}  // namespace sbp
