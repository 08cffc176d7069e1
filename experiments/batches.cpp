#include "experiments/batches.h"

#include <algorithm>
#include <chrono>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "core/io/safetensors.h"
#include "core/methods/memory_model.h"
#include "core/methods/streaming.h"
#include "core/model/checkpoint_io.h"
#include "core/model/chunk_attention_kernels.h"
#include "core/model/gemm.h"
#include "profiler/calibration.h"
#include "profiler/cpu_meter.h"
#include "profiler/cuda_meter.h"
#include "core/io/input_error.h"

namespace sbp {

Batch read_batch_file(const std::filesystem::path& file) {
  Batch batch;
  // A packed batch's boundaries, by the names transformers' DataCollatorWithFlattening and flash-attention give them.
  std::map<std::string, at::Tensor> boundaries;
  for (const auto& t : read_safetensors(file)) {
    if (t.name == "input_ids")
      batch.input_ids = t.tensor;
    else if (t.name == "attention_mask")
      batch.attention_mask = t.tensor;
    else if (t.name == "position_ids" || t.name == "cu_seqlens" || t.name.rfind("cu_seq_lens_", 0) == 0 ||
             t.name.rfind("max_length_", 0) == 0)
      boundaries[t.name] = t.tensor;
    else
      batch.fields[t.name] = t.tensor;  // the objective checks its own (names, shapes, dtypes)
  }
  const auto source = file.string();
  if (!batch.input_ids.defined()) throw InputError(source + ": missing tensor 'input_ids'");
  if (!boundaries.empty()) {
    read_packed_boundaries(batch, boundaries, source);
    // DataCollatorWithFlattening writes no attention_mask: every position of a packed row is a token.
    if (!batch.attention_mask.defined()) batch.attention_mask = at::ones_like(batch.input_ids);
  }
  if (!batch.attention_mask.defined()) throw InputError(source + ": missing tensor 'attention_mask'");
  return batch;
}

void write_batch_file(const Batch& b, const std::filesystem::path& file) {
  TensorList tensors = {{"input_ids", b.input_ids}, {"attention_mask", b.attention_mask}};
  if (b.packed) {  // both spellings, so that either kind of reader finds its own
    tensors.push_back({"position_ids", b.packed->position_ids()});
    tensors.push_back({"cu_seqlens", b.packed->cu_seqlens()});
  }
  for (const auto& [name, tensor] : b.fields) tensors.push_back({name, tensor});
  write_safetensors(file, tensors);
}

void read_packed_boundaries(Batch& batch, const std::map<std::string, at::Tensor>& given, const std::string& source) {
  const auto get = [&](const char* name) {
    const auto it = given.find(name);
    return it == given.end() ? at::Tensor() : it->second;
  };
  for (const auto& [name, t] : given)
    if (name != "position_ids" && name != "cu_seqlens" && name != "cu_seq_lens_q" && name != "cu_seq_lens_k" &&
        name != "max_length_q" && name != "max_length_k")
      throw InputError(source + ": unexpected tensor '" + name + "' (a packed batch's boundaries are position_ids, "
                       "cu_seqlens, or HF's cu_seq_lens_q/k with max_length_q/k)");
  // HF's flash-attention kwargs: queries and keys over the same tokens, so one set of boundaries.
  auto cu = get("cu_seqlens");
  for (const char* name : {"cu_seq_lens_q", "cu_seq_lens_k"}) {
    const auto t = get(name);
    if (!t.defined()) continue;
    if (cu.defined() && !(t.sizes() == cu.sizes() && t.to(at::kLong).equal(cu.to(at::kLong))))
      throw InputError(source + ": " + name + " differs from the other cumulative lengths: a training batch's queries "
                       "and keys are the same tokens");
    cu = t;
  }
  set_sequence_boundaries(batch, get("position_ids"), cu, source);
  if (!batch.packed)
    throw InputError(source + ": max_length_q/k without the boundaries (position_ids or cu_seqlens) they describe");
  std::int64_t longest = 0;
  for (std::int64_t r = 0; r < batch.packed->rows(); ++r)
    for (const auto s : batch.packed->starts(r)) longest = std::max(longest, batch.packed->sequence_end(r, s) - s);
  for (const char* name : {"max_length_q", "max_length_k"})
    if (const auto t = get(name); t.defined() && !(t.numel() == 1 && t.to(at::kLong).item<std::int64_t>() == longest))
      throw InputError(source + ": " + name + " must be the longest sequence's length, " + std::to_string(longest));
}

namespace {

// Chunks of the reference pass: StreamBP's defaults (the pass is StreamBP's forward without checkpoints).
constexpr std::int64_t kReferenceLayerChunk = 512, kReferenceHeadChunk = 1024;

// The first architecture field in which two configs differ, or "".
std::string architecture_difference(const ModelConfig& a, const ModelConfig& b) {
  const std::pair<const char*, std::pair<std::int64_t, std::int64_t>> fields[] = {
      {"vocab_size", {a.vocab_size, b.vocab_size}},
      {"hidden_size", {a.hidden_size, b.hidden_size}},
      {"intermediate_size", {a.intermediate_size, b.intermediate_size}},
      {"num_hidden_layers", {a.num_hidden_layers, b.num_hidden_layers}},
      {"num_attention_heads", {a.num_attention_heads, b.num_attention_heads}},
      {"num_key_value_heads", {a.num_key_value_heads, b.num_key_value_heads}},
      {"head_dim", {a.head_dim, b.head_dim}},
      {"qk_norm", {a.qk_norm, b.qk_norm}},
      {"attention_bias", {a.attention_bias, b.attention_bias}},
      {"tie_word_embeddings", {a.tie_word_embeddings, b.tie_word_embeddings}}};
  for (const auto& [name, values] : fields)
    if (values.first != values.second)
      return std::string(name) + " " + std::to_string(values.second) + " (the policy has " + std::to_string(values.first) + ")";
  return "";
}

}  // namespace

Workload make_workload(const Model& model, const PreparedObjective& objective, const Batch& batch) {
  Workload w{model.config(), model.dtype(), batch.batch_size(), batch.seq_len(), objective.buffer_bytes_per_token(),
             objective.needs_statistics()};
  if (batch.packed) {
    PackedLengths lengths;
    for (std::int64_t r = 0; r < batch.packed->rows(); ++r) {
      auto& row = lengths.rows.emplace_back();
      for (const auto s : batch.packed->starts(r)) row.push_back(batch.packed->sequence_end(r, s) - s);
    }
    w.packed = std::make_shared<const PackedLengths>(std::move(lengths));
  }
  w.threads = at::get_num_threads();
  w.graph_keeps_weight_views = !(model.device().is_cpu() && gemm_paths(model.dtype()).any_widened());
  if (model.device().is_cpu()) {
    const auto attention = choose_chunk_attention(c10::DeviceType::CPU, model.dtype());
    w.narrow_attention_blocks = attention.blocks && attention.blocks->narrow_operands;
  }
  w.workspaces = machine_workspaces(model.device());
  w.grad_dtype = model.grad_dtype();
  const auto& lora = model.lora();
  if (lora.enabled()) {
    w.lora_rank = lora.rank;
    w.lora_parameters = lora_parameter_count(model.config(), lora);  // ZeRO-3 empties the adapters between uses
    for (const auto& t : lora.targets) (t == "gate" || t == "up" || t == "down" ? w.lora_mlp_targets : w.lora_attention_targets)++;
    w.lora_targets.assign(lora.targets.begin(), lora.targets.end());
  }
  return w;
}

ReferencePass complete_batch(const Model& model, const Objective& objective, Batch& batch, const std::string& source,
                             bool random, const std::string& ref_dir, c10::ScalarType dtype, std::uint64_t seed) {
  if (batch.packed)  // before any pass over the batch: a refused layout is refused first
    if (const auto why = objective.packed_rows_refusal(); !why.empty()) throw InputError(source + ": " + why);
  if (!ref_dir.empty() && batch.has("ref_logps"))
    throw InputError(source + " carries ref_logps and --ref " + ref_dir + " is given: use one of them");
  const bool lora = model.lora().enabled();
  if (random && objective.wants_policy_logps())
    objective.add_synthetic_logps(batch, sequence_logps(model, batch, objective.temperature()), seed,
                                  /*reference_given=*/!ref_dir.empty() || lora);
  ReferencePass pass;
  if (!objective.needs_reference(batch)) {
    if (!ref_dir.empty())
      throw InputError("--ref " + ref_dir + ": objective " + objective.spec() + " reads no reference log-probs");
    return pass;
  }
  if (ref_dir.empty() && !lora)
    throw InputError(source + ": objective " + objective.name() + " needs ref_logps in the batch or --ref DIR (a reference model)");
  // The pass runs where the policy lives, measured by that device's meter.
  auto& cpu_meter = CpuMemoryMeter::install();
  auto* cuda_meter = model.device().is_cuda() ? &CudaMemoryMeter::for_device(model.device().index()) : nullptr;
  const auto live_bytes = [&] { return cuda_meter ? cuda_meter->current_bytes() : cpu_meter.current_bytes(); };
  const auto before = live_bytes();
  cuda_meter ? cuda_meter->reset_peak() : cpu_meter.reset_peak();
  const auto start = std::chrono::steady_clock::now();
  if (ref_dir.empty()) {  // LoRA: the base model is the reference, on its own hidden states
    const Model::AdaptersDisabled base(model);
    batch = objective.with_reference(batch, sequence_logps(model, batch, objective.temperature(),
                                                           kReferenceLayerChunk, kReferenceHeadChunk));
  } else {
    const auto reference = load_model_dir(ref_dir, dtype);
    reference->to(model.device());
    if (const auto diff = architecture_difference(model.config(), reference->config()); !diff.empty())
      throw InputError(ref_dir + "/config.json: the reference model must have the policy's architecture and "
                                  "vocabulary; it has " + diff);
    batch = objective.with_reference(batch, sequence_logps(*reference, batch, objective.temperature(),
                                                           kReferenceLayerChunk, kReferenceHeadChunk));
  }
  pass.ran = true;
  pass.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  synchronize(model.device());
  pass.peak_bytes = (cuda_meter ? cuda_meter->peak_bytes() : cpu_meter.peak_bytes()) - before;
  auto workload = make_workload(model, objective.prepare(batch, model.config(), std::nullopt, source), batch);
  workload.lora_rank = workload.lora_parameters = 0;  // the reference computes the base function
  pass.model = reference_pass_memory(workload, kReferenceLayerChunk, kReferenceHeadChunk,
                                     /*separate_weights=*/!ref_dir.empty());
  return pass;
}

void pack_workload(Workload& w, const LengthDistribution& pack, std::uint64_t seed) {
  w.packed.reset();
  if (!pack.packed()) return;
  w.packed = std::make_shared<const PackedLengths>(PackedLengths{pack.draw(w.batch_size, w.seq_len, seed)});
}

Batch prepared_random_batch(const Model& model, const Objective& objective, std::int64_t batch_size,
                            std::int64_t seq_len, std::int64_t group, std::uint64_t seed, const LengthDistribution& pack) {
  auto batch = objective.random_batch(model.config(),
                                      {batch_size, seq_len, 0.0, objective.default_prompt_fraction(), seed, group, pack})
                   .to(model.device());
  complete_batch(model, objective, batch, "random batch", true, "", model.dtype(), seed);
  objective.prepare(batch, model.config(), std::nullopt, "random batch");  // its checks
  return batch;
}

}  // namespace sbp
