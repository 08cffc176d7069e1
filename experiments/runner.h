// What every command and driver shares: building the model and the batch a run asks for, and measuring one BP
// method on them (peak bytes from the CPU meter, BP seconds over repeats, status).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/objectives/batch.h"
#include "core/methods/method.h"
#include "core/objectives/objective.h"
#include "core/model/model.h"
#include "experiments/device.h"
#include "experiments/setup.h"
#include "profiler/cpu_meter.h"

namespace sbp {

class Trainer;

std::unique_ptr<Model> build_model(const ModelSource& source, c10::ScalarType dtype, std::uint64_t seed);

// safetensors: input_ids and attention_mask (I64) and the objective's tensors (Batch::fields), by name.
Batch read_batch_file(const std::filesystem::path& file);
void write_batch_file(const Batch& batch, const std::filesystem::path& file);

// The memory models' view of a run: shape, dtype, the (prepared) objective's buffers and statistics pass, LoRA.
Workload make_workload(const Model& model, const Objective& objective, const Batch& batch);

// --lora SPEC and/or --adapter DIR on a freshly built model (nothing when both are empty).
void apply_lora(Model& model, const std::string& lora_spec, const std::string& adapter_dir, std::uint64_t seed);

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
// Throws std::invalid_argument (exit 2) when the reference is needed but not given, given but not used, or of
// another architecture.
ReferencePass complete_batch(const Model& model, const Objective& objective, Batch& batch, const std::string& source,
                             bool random, const std::string& ref_dir, c10::ScalarType dtype, std::uint64_t seed);

struct Measurement {
  std::string status = "passed";  // "passed", "oom" (budget exceeded), "error"
  std::string error;
  double loss = 0;
  std::vector<double> bp_seconds;  // one per measured repeat
  // Bytes live at the step's peak, counting the model's weights and what the step allocated; bytes the caller held
  // before the step (reference gradients, other models) are not counted.
  std::int64_t peak_bytes = 0;
  std::int64_t weight_bytes = 0;  // base parameters and LoRA adapters
  std::int64_t largest_allocation_bytes = 0;  // largest single block (no [T, T] tile ever exists in StreamBP)
  // CUDA only (-1 on the CPU): the caching allocator's reserved-bytes peak of the last step, what cudaMalloc held
  // (CUPTI's memory curve is the same quantity).
  std::int64_t reserved_peak_bytes = -1;
  std::vector<PhaseTime> phases;       // of the last repeat
  std::vector<PhasePeak> phase_peaks;  // in the same accounting as peak_bytes
  double median_seconds() const;
};

// A random B x T batch on the model's device for the drivers' measurements (SFT: the first 10% of each row is prompt; GRPO/DPO draw
// theirs), its log-probs completed and the objective prepared on it.
Batch prepared_random_batch(const Model& model, Objective& objective, std::int64_t batch_size, std::int64_t seq_len,
                            std::int64_t group, std::uint64_t seed);

// Runs warmup + repeats steps on the model's device, measured by that device's meter: the CPU meter (every tensor
// byte), or on CUDA the caching allocator's allocated bytes (profiler/cuda_meter.h). budget_bytes > 0 caps peak_bytes
// (the step then ends with status "oom"); on CUDA it caps the allocator's reserved bytes, as a GPU of that size would.
Measurement measure_method(Model& model, BackpropMethod& method, Objective& objective, const Batch& batch,
                           int warmup, int repeats, std::int64_t budget_bytes);

// measure_method for training steps (BP + optimizer update) of `trainer` on its model: the peak counts the optimizer's
// states too (bp_seconds: the BP of each step, without the update). Its first step creates the states after the BP, so a peak with the
// states present during the BP needs repeats + warmup >= 2 (the peak is the largest of all steps).
Measurement measure_training(Trainer& trainer, const Batch& batch, int warmup, int repeats, std::int64_t budget_bytes);

std::string format_bytes(std::int64_t bytes);  // "1.23 GiB"
// The model's own bytes: base weights and LoRA adapters (fp32 masters in mixed precision), what a step's peak counts.
std::int64_t model_weight_bytes(const Model& model);
// This machine's dense GEMM rate in `dtype` at the current thread count: the best of `repeats` n x n x n products
// (after one warm-up) on `device`, in FLOP/s: the yardstick of a method's achieved FLOP/s.
double gemm_flops_per_second(c10::ScalarType dtype, std::int64_t n = 2048, int repeats = 5,
                             c10::Device device = c10::Device(c10::kCPU));
// "a;b;;c" -> {a, b, c}: a flag's list (empty items dropped).
std::vector<std::string> split_list(const std::string& text, char sep);
// Refuses to overwrite an existing result unless `force` (results are never overwritten silently), and a file whose
// folder does not exist (found before the work, not when writing after it).
void check_new_output(const std::filesystem::path& file, bool force, const std::string& flag);
// The same for an output folder (--save-model, --save-adapter), which is created with its parents when written.
void check_new_folder(const std::filesystem::path& folder, bool force, const std::string& flag);

}  // namespace sbp
