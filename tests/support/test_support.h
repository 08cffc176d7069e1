// What several test files share: a scratch folder, raw file bytes, one BP step that keeps its gradients, and the
// small model configurations the exactness tests sweep over.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "core/objectives/batch.h"
#include "core/model/config.h"
#include "core/model/model.h"
#include "core/objectives/objective.h"
#include "core/io/safetensors.h"
#include "profiler/cpu_meter.h"  // PhasePeak

namespace sbp {
struct MemoryEstimate;  // core/methods/workload.h
}

namespace sbp::test {

// ARCHITECTURE.md §4: the fp64 gate. Summation-order differences in fp64 give ~1e-15 relative error per operation; a few
// hundred accumulated operations stay far below this, while any real bug (a wrong mask, a dropped term) is O(1).
inline constexpr double kFp64Rtol = 1e-10;
// Losses are one scalar sum; different chunkings reorder it, nothing else.
inline constexpr double kLossRtol = 1e-12;
inline constexpr std::int64_t kMiB = 1 << 20;

// A fresh folder under the system temp directory, removed with everything in it.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "sbp_test_");
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir();
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

std::string read_bytes(const std::filesystem::path& file);
void write_bytes(const std::filesystem::path& file, const std::string& bytes);

// One step of the method `spec` (see make_method) with an objective (default: SFT): its loss and a copy of every
// parameter's gradient in HF names (a copy, so that the next step on the same model cannot touch it).
struct StepGradients {
  double loss = 0;
  TensorList gradients;
};
StepGradients run_step(Model& model, const std::string& spec, const Batch& batch);
StepGradients run_step(Model& model, const std::string& spec, Objective& objective, const Batch& batch);

// A random batch of `objective`'s format, completed as `streambp run` completes one: old_logps and synthetic
// ref_logps from the model's own log-probs (Objective::add_synthetic_logps).
Batch objective_batch(const Model& model, const Objective& objective, const RandomBatchOptions& options);

// A Qwen3-family config of test size: 4 heads of 16 with 2 KV heads (GQA), qk_norm on, tied, 2 layers, d = 64,
// vocabulary 512 (the "tiny" preset). Callers flip the flags they exercise.
ModelConfig tiny_config();
// tiny_config() untied, with 4 KV heads (MHA), no qk_norm and every bias (q/k/v and o): the other corner of the flags.
ModelConfig untied_mha_with_biases();

// "d=64,L=2,heads=4x16,kv=2,V=512,I=128,tied=1,qk_norm=1,bias=0,o_bias=0": the parameters a failing case needs.
std::string describe(const ModelConfig& config);

// Two training runs apart: the largest relative difference of their per-step losses and (normwise, every tensor) of
// their final trainable tensors. Throws std::runtime_error when the runs have different step counts or tensors.
double trajectory_difference(const std::vector<double>& losses_a, const TensorList& params_a,
                             const std::vector<double>& losses_b, const TensorList& params_b);

// The named phase's peak in a meter's list (CPU or CUDA), or null.
const PhasePeak* find_phase(const std::vector<PhasePeak>& peaks, const std::string& name);

// Whether a measured peak matches its model within 3 percent. Where the model's moment holds the attention
// kernel's per-worker scratch (all workers at once: the calibration's coincident peak), a step in which the workers
// did not overlap reads lower by up to the other workers' share of it; that much lower also matches. (Seen in CI,
// never in a direct run: MsT LoRA bf16, V = 4096, T = 512, 2,875,020 bytes against 3,012,104 in every one of four
// steps of one process; MsT bf16 training with its parameters offloaded, 3.4% low.)
bool matches_model(std::int64_t measured, const MemoryEstimate& estimate);

}  // namespace sbp::test
