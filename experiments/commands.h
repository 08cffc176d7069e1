// The subcommands of the `streambp` CLI. Each returns the process exit code: 0 only when everything it was asked
// to do worked and every check it ran passed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "experiments/options.h"
#include "experiments/ranks.h"
#include "experiments/batches.h"
#include "experiments/device.h"
#include "experiments/measure.h"
#include "experiments/setup.h"

namespace CLI {
class App;
}

namespace sbp {

struct RunArgs {
  Setup setup;  // model, precision, LoRA, objective, device, threads, seed
  std::string method = "standard";
  MeasureOptions measure{.batch_sizes = {1}};  // --seq, --batch; run: --warmup, --repeats, --budget-bytes
  double pad_fraction = 0, prompt_fraction = 0;
  LengthDistribution pack;  // --pack: random rows packed with sequences of these lengths (SFT)
  std::string batch_file, ref_dir, save_adapter;
  std::string save_grads, save_model, save_batch, json, timeline, op_profile;
  std::string profile;  // --profile cupti
  OffloadOptions offload;  // --offload, --offload-dir
  bool force = false, model_only = false;
  bool no_memory_check = false;  // run: --no-memory-check, the step even when its modelled peak does not fit
};
void add_run_options(CLI::App& app, RunArgs& args);
// The model, method, objective, batch, precision, device and output options `run` and `train` share.
void add_model_options(CLI::App& app, RunArgs& args);
// What those options ask for, built in one place: the dtype (--dtype, else the --load checkpoint's, else fp32) and
// the model (source, --lora/--adapter, --grad-dtype), method and objective.
struct RunParts {
  c10::ScalarType dtype;
  std::unique_ptr<Model> model;
  std::unique_ptr<BackpropMethod> method;
  std::shared_ptr<const Objective> objective;
};
RunParts build_run_parts(const RunArgs& args);
int run_command(const RunArgs& args, const std::string& command_line);

struct TrainArgs {
  RunArgs run;  // model, method, objective, random batch, precision, LoRA, device, --save-model, --json
  std::int64_t steps = 1, grad_accum = 1, save_every = 0;
  OptimizerFlags optimizer{.spec = "adamw"};
  std::string lr_schedule = "constant";
  double clip_grad_norm = 0;
  std::string data_dir, checkpoint_dir, resume_dir, metrics;
  std::string micro_batches;  // --micro-batches "0;1,2;3": each step's micro-batches by rows (empty: --grad-accum's)
  bool no_memory_check = false;  // --no-memory-check: train even when the model's peak does not fit
  RankFlags ranks;           // --nproc, --zero, --dist-timeout
};
void add_train_options(CLI::App& app, TrainArgs& args);
int train_command(const TrainArgs& args, const std::string& command_line);

struct CompareArgs {
  std::string ref, other, json;
  // The low-precision rule instead of --rtol: REF is the fp64 oracle, OTHER and `baseline` are gradients in `dtype`.
  std::string baseline, dtype;
  double rtol = 1e-10;
  bool force = false;
};
void add_compare_options(CLI::App& app, CompareArgs& args);
int compare_command(const CompareArgs& args, const std::string& command_line);

struct RlStepArgs {
  std::string load, case_file, out, method = "standard";
  bool force = false;
};
void add_rl_step_options(CLI::App& app, RlStepArgs& args);
int rl_step_command(const RlStepArgs& args, const std::string& command_line);

struct DemoArgs {
  Setup setup;  // default model: qwen3-small
  std::vector<std::string> methods = {"standard", "checkpoint", "streambp"};
  MeasureOptions measure{.seq_lens = {2048, 4096}, .batch_sizes = {1}, .repeats = 2, .check_seq_len = 700};
  OutputOptions output{.out_dir = "results/demo"};
};
void add_demo_options(CLI::App& app, DemoArgs& args);
int demo_command(const DemoArgs& args, const std::string& command_line);

// One measurement sweep (cmd_sweep.cpp): every method at every (B, T), methods interleaved; `demo` and `sweep` fill it.
struct SweepPlan {
  Setup setup;
  std::vector<std::string> methods;  // specs, checked by make_method
  std::vector<std::int64_t> seq_lens, batch_sizes;
  std::int64_t check_seq_len = 300, budget_bytes = 0;
  int repeats = 2;
  std::string out_dir, stem, resume;  // resume: a CSV of the same sweep to continue
  RankFlags ranks;
};
int run_sweep(const SweepPlan& plan, const std::string& command_line);
struct SweepArgs {
  std::string kind;  // seq, batch, partition
  Setup setup;       // default model: qwen3-small
  std::vector<std::string> methods;  // empty: the kind's (cmd_sweep.cpp)
  MeasureOptions measure{.repeats = 2, .check_seq_len = 300};  // empty --seq/--batch: the kind's
  std::vector<std::int64_t> layer_chunks = {256, 512, 1024, 1365}, head_chunks = {256, 1024};
  OutputOptions output;  // empty: results/<kind>
  std::string resume;
  RankFlags ranks;  // data-parallel points: each rank takes --batch / N rows
};
void add_sweep_options(CLI::App& app, SweepArgs& args);
int sweep_command(const SweepArgs& args, const std::string& command_line);

struct MaxlenArgs {
  Setup setup;  // default model: qwen3-small
  std::vector<std::string> methods = {"checkpoint", "mst", "streambp"};
  MeasureOptions measure{.batch_sizes = {1}};  // --batch, --budget-bytes (required)
  OutputOptions output{.out_dir = "results/maxlen"};
  std::int64_t max_seq = std::int64_t(1) << 20;
  double step = 0.02;
  // Training: the optimizer whose states and update share the budget (none: forward + backward only).
  OptimizerFlags optimizer;
  OffloadOptions offload;  // the budget is the device's; the tier's bytes are reported beside it
  bool model_only = false;
  RankFlags ranks;  // data-parallel probes: each rank takes --batch / N rows, the budget per rank
  LengthDistribution pack;  // --pack: every probe's rows packed with sequences of these lengths (one process, SFT)
};
void add_maxlen_options(CLI::App& app, MaxlenArgs& args);
int maxlen_command(const MaxlenArgs& args, const std::string& command_line);

struct ConformArgs {
  std::string impl, baseline = "hf", cases = "quick", work_dir, junit;  // junit: a JUnit XML report (issue #47)
  std::string judge_dir;  // a kept case directory, judged again as it is (issue #62)
  std::vector<std::string> objectives, dtypes, only;  // empty: every one of the matrix; only: case names
  OutputOptions output{.out_dir = "results/conform"};
  bool lora_only = false, list_cases = false;
  double timeout = 300;  // seconds per case
  std::string accumulation = "union";  // what micro-batch cases are judged against (verify/conformance.h)
};
void add_conform_options(CLI::App& app, ConformArgs& args);
int conform_command(const ConformArgs& args, const std::string& command_line);

struct ProjectArgs {
  std::int64_t budget_bytes = 80'000'000'000, lora_rank = 32;
  OutputOptions output{.out_dir = "results/projection"};
  // Folders of measured runs (peak / model): the projections' error bars. Empty: results/grid when it exists.
  std::vector<std::string> error_dirs;
  std::string error_presets = "qwen3";  // the runs that count: presets starting with this
  // Training: the optimizer whose states and update share the budget (none: forward + backward only); its states
  // in the trainable tensors' dtype unless --optimizer-state-dtype (bf16 for the paper's pure-bf16 full training).
  OptimizerFlags optimizer;
  // Data-parallel training (the paper's Table 4): per-rank memory over each of these world sizes at this ZeRO stage.
  std::vector<int> world_sizes;  // empty: the single-GPU Table 3
  int zero = 0;
  // Beside ALST (experiments/project_offload.cpp): what moves to the offload tier, and the GPU's own floor taken off
  // the budget (a named assumption, not a measurement).
  OffloadOptions offload;
  std::int64_t gpu_floor_bytes = 2'000'000'000;
  // Sequence parallelism beside ALST (experiments/project_sequence.cpp): each sequence over sp ranks of nproc
  // (0: nproc = sp).
  int sp = 0, nproc = 0;
  SequenceScheme sp_scheme = SequenceScheme::allgather;
  // The host memory of a node of 8 devices, which the offload tier must fit (ALST's nodes had 1.9 TB per 8 H100s).
  double host_bytes_per_node = 2e12;
  // The third tier (issue #61): node-local disk of a node of 8 devices for the checkpoints the host cannot hold, read
  // back at this many bytes per second per node; 0 bytes: no disk tier. The device's rate (FLOP/s) against which a
  // layer's read is timed: its backward's compute (the stall factor).
  double disk_bytes_per_node = 0, disk_read_bandwidth = 0, device_flops = 989e12;
  // --pack: SFT's rows packed with sequences of these lengths, drawn at every T (Table 3 and --world).
  LengthDistribution pack;
};
void add_project_options(CLI::App& app, ProjectArgs& args);
int project_command(const ProjectArgs& args, const std::string& command_line);
int project_offload(const ProjectArgs& args, const std::string& command_line);
int project_sequence_parallel(const ProjectArgs& args, const std::string& command_line);

struct ProfileArgs {
  Setup setup;  // default model: qwen3-small; CPU only
  std::vector<std::string> methods = {"checkpoint", "streambp"};
  MeasureOptions measure{.seq_lens = {4096}, .batch_sizes = {1}};
  OutputOptions output{.out_dir = "results/profile"};
  int steps = 2;
  bool no_memory_check = false;  // profile even a method whose modelled peak does not fit
};
void add_profile_options(CLI::App& app, ProfileArgs& args);
int profile_command(const ProfileArgs& args, const std::string& command_line);

// `pack-gain` (cmd_pack_gain.cpp): one method on packed rows against the same sequences padded to the longest.
struct PackGainArgs {
  Setup setup;  // default model: qwen3-small; CPU only
  std::string method;  // --method, required
  MeasureOptions measure{.seq_lens = {4096}, .batch_sizes = {1}, .warmup = 1, .repeats = 3};
  LengthDistribution pack;  // --pack, required
  OutputOptions output{.out_dir = "results/packing"};
  bool no_check = false;
};
void add_pack_gain_options(CLI::App& app, PackGainArgs& args);
int pack_gain_command(const PackGainArgs& args, const std::string& command_line);

struct ReproduceArgs {
  std::string table;
  bool dry_run = false;
  int threads = 0;
};
void add_reproduce_options(CLI::App& app, ReproduceArgs& args);
int reproduce_command(const ReproduceArgs& args, const std::string& command_line);

struct VerifyArgs {
  Setup setup;  // default model: tiny; the dtypes are the verification's own; the device takes the fp32/bf16 runs,
                // the fp64 oracle always runs on the CPU
  std::string batch_file;
  LengthDistribution pack;  // --pack: a random batch of packed rows (SFT)
  std::vector<std::string> methods = {"streambp"};
  MeasureOptions measure{.seq_lens = {512}, .batch_sizes = {1}};
  OutputOptions output{.out_dir = "results/verify"};
  bool gate = false, mixed = false;
};
void add_verify_options(CLI::App& app, VerifyArgs& args);
int verify_command(const VerifyArgs& args, const std::string& command_line);

struct ToyArgs {
  std::int64_t rows = 16384, dim = 1024;
  std::vector<std::int64_t> partitions = {1, 4, 16, 64, 256, 1024};
  std::string data = "integer";
  OutputOptions output{.out_dir = "results/partition"};
  int repeats = 3, threads = 0;
  std::uint64_t seed = 0;
};
void add_toy_options(CLI::App& app, ToyArgs& args);
int toy_command(const ToyArgs& args, const std::string& command_line);

struct GemmPathArgs {
  bool remeasure = false;
  int threads = 0;
};
void add_gemm_path_options(CLI::App& app, GemmPathArgs& args);
int gemm_path_command(const GemmPathArgs& args, const std::string& command_line);

}  // namespace sbp
