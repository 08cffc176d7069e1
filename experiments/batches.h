// The batches a command runs on: batch files (safetensors) in and out, random batches completed with the log-probs
// their objective needs (old and reference log-probs from a chunked no-grad pass), and the memory models' view of a
// step on one (its Workload).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>

#include "core/methods/workload.h"
#include "core/objectives/batch.h"
#include "core/objectives/objective.h"
#include "core/model/model.h"
#include "core/io/input_error.h"

namespace sbp {

// safetensors: input_ids and attention_mask (I64) and the objective's tensors (Batch::fields), by name. A packed
// batch adds its boundaries (position_ids and/or cu_seqlens, or HF's cu_seq_lens_q/k and max_length_q/k; its
// attention_mask may then be absent, as DataCollatorWithFlattening writes none); written with both spellings.
Batch read_batch_file(const std::filesystem::path& file);
void write_batch_file(const Batch& batch, const std::filesystem::path& file);
// The boundaries among a batch file's tensors (by their names above) set on `batch`, every given one checked against
// the others. Throws InputError naming `source`.
void read_packed_boundaries(Batch& batch, const std::map<std::string, at::Tensor>& given, const std::string& source);

// The memory models' view of a run: shape, dtype, the objective's buffers and statistics pass as prepared on `batch`,
// LoRA.
Workload make_workload(const Model& model, const PreparedObjective& objective, const Batch& batch);
// The packed lengths of a workload at its seq_len, drawn as a random packed batch of its rows draws them (`pack` with
// `seed`: the same lengths as random_packed_sft_batch), or none when `pack` packs nothing: a search over T (maxlen,
// project) gives each T its own rows.
void pack_workload(Workload& w, const LengthDistribution& pack, std::uint64_t seed);

struct ReferencePass {
  bool ran = false;
  double seconds = 0;
  std::int64_t peak_bytes = 0;  // bytes the pass added on top of what was live before it (reference weights included)
  MemoryEstimate model;         // reference_pass_memory of the same workload
};
// The log-probs a batch needs beyond its tokens, filled in before the step (outside the measured BP):
// - a random batch of an objective that wants them gets old_logps / synthetic ref_logps from the policy's own
//   chunked no-grad pass (Objective::add_synthetic_logps);
// - ref_logps from a reference model (`ref_dir`, an HF checkpoint of the same architecture and vocabulary), by a
//   chunked no-grad pass over its own hidden states, when the objective needs them and the batch lacks them;
//   under LoRA without --ref, the reference is the base model itself with its adapters disabled.
// Throws InputError (exit 2) when the reference is needed but not given, given but not used, or of
// another architecture.
ReferencePass complete_batch(const Model& model, const Objective& objective, Batch& batch, const std::string& source,
                             bool random, const std::string& ref_dir, c10::ScalarType dtype, std::uint64_t seed);

// A random B x T batch on the model's device for the drivers' measurements (SFT: the first 10% of each row is prompt; GRPO/DPO draw
// theirs), its log-probs completed and checked by preparing the objective on it.
// `pack`: rows packed with sequences of its lengths (SFT).
Batch prepared_random_batch(const Model& model, const Objective& objective, std::int64_t batch_size,
                            std::int64_t seq_len, std::int64_t group, std::uint64_t seed,
                            const LengthDistribution& pack = {});

}  // namespace sbp
