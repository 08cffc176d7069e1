// conform's packed cases (issue #59): rows holding several sequences each, described by each row's sequence lengths
// rather than by tensors. SFT rows as transformers' DataCollatorWithFlattening writes them (position_ids restarting at
// 0, each sequence's first label -100); a row whose lengths sum to less than the case's T is a ragged last pack: right
// padding after its last sequence (attention_mask 0, labels -100), the padding a segment of its own in
// position_ids/cu_seqlens so that no sequence grows by it. GRPO rows in verl's remove-padding layout (docs/packing.md
// "GRPO on packed rows"): each sequence one completion (its prompt first) with its own advantage, `advantages` one
// value per sequence in cu_seqlens order; its rows are full, since a padding segment would be a sequence of its own,
// counted by grpo's and dr_grpo's normalisers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/objectives/batch.h"
#include "verify/conformance.h"

namespace sbp {

class Objective;

// `c` with its rows packed by `lengths` (one list a row, its sequences' lengths in order): batch_size becomes the
// number of rows; seq_len stays the case's T, which every row's lengths must fit.
ConformCase packed_case(ConformCase c, std::vector<std::vector<std::int64_t>> lengths);
// What is wrong with a case's pack_lengths (empty: nothing, or not packed): neither SFT nor GRPO, one list per row,
// lengths >= 1, each row within T (GRPO: exactly T) and starting with a sequence.
std::string pack_lengths_problem(const ConformCase& c);
// The case's batch: its packed rows (random tokens of its seed; SFT labels as the collator writes them, the leading
// prompt_fraction of each sequence's labels -100, at least its first; GRPO packed_grpo_batch's completions and
// per-sequence advantages, grouped by the case's group), or the objective's random batch.
Batch conform_batch(const ConformCase& c, const Objective& objective);
// case.json's packed keys (a packed case only, so that older adapters see the case.json they know): "packed": true,
// "sequences" (each row's sequence lengths, the padding not among them) and "max_length" (the longest segment of
// cu_seqlens: a varlen kernel's bound); a GRPO case also "per_sequence": ["advantages"], the batch tensors that hold
// one value per packed sequence (cu_seqlens order) where a padded case holds one per row.
void add_packed_case_json(const ConformCase& c, nlohmann::json& out);

}  // namespace sbp
