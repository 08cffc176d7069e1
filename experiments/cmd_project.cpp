// `streambp project`: the analytic memory models evaluated at the paper's Table 3 settings (Qwen3-4B/8B/14B/32B,
// bf16, layer partition 500 and logits partition 100, LoRA rank 32 in mixed precision, one 80 GB GPU; SFT and DPO at
// batch 1 pair, GRPO with a group of 8): the largest T whose modelled peak fits, per method and objective, beside the
// paper's measured maximum where its table labels it. Each projection carries an error bar: the range of measured /
// modelled peak over every CPU run in the --errors folders (results/grid by default), applied to the budget. These are
// projections of the CPU-measured models, not GPU measurements: a GPU run also holds the CUDA context, the caching
// allocator's fragmentation and the kernels' workspaces, which the models leave out (no_kernel_workspaces: this CPU's
// calibration would not describe a GPU's kernels).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>
#include <stdexcept>
#include <tuple>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "baselines/methods.h"
#include "core/model/config.h"
#include "core/methods/memory_model.h"
#include "core/training/training_memory.h"
#include "core/training/optimizer_shard.h"
#include "core/objectives/objective.h"
#include "core/training/optimizer.h"
#include "experiments/commands.h"
#include "experiments/results_table.h"
#include "core/io/input_error.h"

namespace sbp {
namespace {

struct Setting {
  const char* preset;
  bool lora;
  double standard, checkpoint, streambp;  // the paper's Table 3, SFT, thousands of tokens
};
// Table 3 (SFT): baseline without checkpointing, with checkpointing, StreamBP. The paper's GRPO and DPO rows have 4
// and 5 entries under these 6 columns without saying which: they are printed as the paper gives them, not paired.
constexpr Setting kSettings[] = {{"qwen3-4b", false, 7.0, 28.5, 200.0},  {"qwen3-4b", true, 7.1, 36.5, 247.0},
                                 {"qwen3-8b", false, 3.4, 15.7, 72.0},   {"qwen3-8b", true, 5.1, 30.6, 142.4},
                                 {"qwen3-14b", true, 2.9, 23.0, 84.6},   {"qwen3-32b", true, 0.4, 5.9, 16.3}};
// Table 4 (ZeRO-2, Qwen3-8B full training, SFT, one sequence per GPU): maximum T in thousands over 3..8 GPUs.
constexpr int kPaperTable4Gpus[] = {3, 4, 5, 6, 7, 8};
constexpr double kPaperTable4Checkpoint[] = {18.6, 20.5, 22.3, 23.1, 23.5, 23.7};
constexpr double kPaperTable4StreamBP[] = {92.4, 112.0, 121.5, 128.7, 131.4, 131.8};
constexpr const char* kPaperGrpo = "w/o ckpt 0.9/1.0/0.7/0.4, w/ ckpt 8.5/12.1/9.5/6.9, StreamBP 18.2/27.5/16.5/10.1";
constexpr const char* kPaperDpo =
    "w/o ckpt 3.1/3.5/2.5/1.4/0.2, w/ ckpt 18.7/32.2/25.5/18.5/4.4, StreamBP 57.2/100.2/60.9/36.9/7.8";

struct ObjectiveSetting {
  const char* spec;
  std::int64_t batch;  // GRPO: the group of 8 completions; DPO: one chosen + rejected pair
};
constexpr ObjectiveSetting kObjectives[] = {{"sft", 1}, {"grpo", 8}, {"dpo", 2}};

// Measured / modelled peak over the runs in `dirs`, per method family (the spec's name: standard, checkpoint, mst,
// streambp). Files that are not results tables, and rows without both numbers (oom, older formats), are skipped.
struct ErrorRange {
  double low = 1, high = 1;
  int runs = 0;
};
std::map<std::string, ErrorRange> measured_errors(const std::vector<std::string>& dirs, const std::string& prefix) {
  std::map<std::string, ErrorRange> out;
  for (const auto& dir : dirs) {
    if (!std::filesystem::is_directory(dir))
      throw InputError("--errors " + dir + ": no such folder (run `streambp reproduce memory-grid` first)");
    for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
      if (entry.path().extension() != ".csv") continue;
      ResultsTable table({});
      try {
        table = ResultsTable::read(entry.path());
      } catch (const std::exception&) {
        continue;
      }
      for (const auto& row : table.rows()) {
        const auto ratio = table.value(row, "peak_over_model");
        if (ratio.empty() || row.status == step_status_name(StepStatus::oom) || row.preset.rfind(prefix, 0) != 0) continue;
        auto& r = out[row.method.substr(0, row.method.find(':'))];
        // A ratio divides the budget: a NaN, an Inf or a 0 would make the bar a number out of nothing.
        const double x = std::strtod(ratio.c_str(), nullptr);
        if (!std::isfinite(x) || x <= 0)
          throw InputError(fmt::format("--errors {}: {} at T = {}: peak_over_model '{}' is not a positive "
                                                  "finite ratio", entry.path().string(), row.method,
                                                  table.value(row, "seq_len"), ratio));
        r.low = r.runs == 0 ? x : std::min(r.low, x);
        r.high = r.runs == 0 ? x : std::max(r.high, x);
        ++r.runs;
      }
    }
  }
  return out;
}

// The workload of a Table 3 run: bf16, batch 1, SFT; LoRA: rank r on all linear layers, fp32 adapters (mixed
// precision, as PEFT keeps them) on a frozen bf16 base.
Workload paper_workload(const ModelConfig& c, bool lora, std::int64_t rank, const Objective& objective,
                        std::int64_t batch) {
  Workload w;
  w.config = c;
  w.dtype = c10::kBFloat16;
  w.batch_size = batch;
  w.objective_bytes_per_token = Objective::kTargetBytesPerToken;
  w.statistics_pass = objective.has_row_term();  // DPO: the streamed head's pass over the row sums
  w.threads = 1;
  // A GPU's kernels (cuBLAS, flash attention) take workspaces this machine cannot measure, and this CPU's would not
  // describe them: the projection models none, and says so.
  w.workspaces = no_kernel_workspaces();
  if (lora) {
    const auto d = c.hidden_size, q = c.q_width(), kv = c.kv_width(), I = c.intermediate_size;
    w.lora_rank = rank;
    w.lora_parameters = c.num_hidden_layers * rank * ((d + q) + 2 * (d + kv) + (q + d) + 2 * (d + I) + (I + d));
    w.lora_attention_targets = 4;
    w.lora_mlp_targets = 3;
    w.lora_targets = {"q", "k", "v", "o", "gate", "up", "down"};
    w.grad_dtype = c10::kFloat;
  }
  return w;
}

// The largest T in [1, hi] whose modelled peak fits the budget (0 if none).
// --pack: the rows at each T are packed with sequences drawn from `pack` (seed 0), the model's attention theirs.
std::int64_t model_max_seq(const BackpropMethod& method, Workload w, std::int64_t budget, std::int64_t hi,
                           const LengthDistribution& pack) {
  auto fits = [&](std::int64_t T) {
    w.seq_len = T;
    pack_workload(w, pack, 0);
    return training_memory(method, w).total_bytes() <= budget;
  };
  if (!fits(1)) return 0;
  std::int64_t lo = 1;
  if (fits(hi)) return hi;
  while (hi - lo > 1) {
    const auto mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

// A projection and its error bar: T* under the budget, and under the budget over the largest and the smallest
// measured/model ratio of `label`'s runs (empty cells without runs).
struct Projected {
  std::int64_t T = 0;
  std::string low, high, bar = "-", runs;
};
Projected project_max_seq(const BackpropMethod& method, const Workload& w, std::int64_t budget,
                          const std::map<std::string, ErrorRange>& errors, const std::string& label,
                          const LengthDistribution& pack) {
  const std::int64_t hi = std::int64_t(1) << 24;
  Projected p;
  p.T = model_max_seq(method, w, budget, hi, pack);
  const auto e = errors.find(label);
  if (e == errors.end()) return p;
  const auto t_low = model_max_seq(method, w, std::int64_t(double(budget) / e->second.high), hi, pack);
  const auto t_high = model_max_seq(method, w, std::int64_t(double(budget) / e->second.low), hi, pack);
  p.low = std::to_string(t_low);
  p.high = std::to_string(t_high);
  p.runs = std::to_string(e->second.runs);
  p.bar = fmt::format("{:.1f}k-{:.1f}k ({} runs)", t_low / 1000.0, t_high / 1000.0, e->second.runs);
  return p;
}

}  // namespace

void add_project_options(CLI::App& app, ProjectArgs& a) {
  app.add_option("--budget-bytes", a.budget_bytes, "device memory (default 80e9: the A800's 80 GB)")->check(CLI::PositiveNumber);
  app.add_option("--lora-rank", a.lora_rank, "LoRA rank of the paper's LoRA columns")->check(CLI::PositiveNumber);
  app.add_option("--errors", a.error_dirs, "folders of measured runs (CSV with peak_over_model): the error bars "
                 "(default: results/grid here when it exists, else the harness's own " + harness_path("results/grid") +
                 ", from `streambp reproduce memory-grid`)");
  app.add_option("--error-presets", a.error_presets, "only runs whose preset starts with this (default qwen3: the real "
                 "vocabulary, as in the projected models; \"\" for every run)");
  add_optimizer_options(app, a.optimizer, "project training steps: the optimizer whose states and update share the "
                        "budget with the step (default: forward + backward only; --world: adamw); its states in the "
                        "trainable tensors' dtype unless --optimizer-state-dtype (bf16 for full bf16 training, fp32 for "
                        "LoRA's fp32 adapters)");
  app.add_option("--world", a.world_sizes, "data-parallel training, the paper's Table 4 (Qwen3-8B full, bf16, SFT, one "
                 "sequence per GPU): the per-rank memory over N GPUs, for each N given (e.g. --world 3,4,5,6,7,8), at "
                 "--zero S; training steps (--optimizer, default adamw)")->delimiter(',');
  app.add_option("--zero", a.zero, "ZeRO stage of --world: 0 = DDP, 1 = optimizer states sharded, 2 = + gradients "
                 "reduce-scattered (the paper's Table 4), 3 = + parameters sharded (a layer gathered while in use, "
                 "the embedding and head for the whole step); default 0");
  add_offload_kinds_option(app, a.offload.kinds, "project beside ALST instead (Llama-3.1-8B and Qwen3-8B, full SFT "
                           "with AdamW, one 80 GB and one 141 GB device): every checkpointing method without offload "
                           "and with these kinds in the second tier, each combination of them");
  app.add_option("--gpu-floor-bytes", a.gpu_floor_bytes, "with --offload: what a GPU holds beyond the models (CUDA "
                 "context, library workspaces, fragmentation), taken off the budget and named in every row (an "
                 "assumption; no GPU here measures it)")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--sp", a.sp, "project StreamBP with sequence parallelism beside ALST instead (Llama-3.1-8B and "
                 "Qwen3-8B, full SFT with AdamW, ZeRO-3): each sequence over N devices of --budget-bytes, with and "
                 "without the --offload kinds; ALST's 3.7M on 8 devices and 15M on 32 beside it")
      ->check(CLI::PositiveNumber);
  app.add_option("--nproc", a.nproc, "with --sp: the devices in all (data-parallel groups of --sp; default --sp)")
      ->check(CLI::PositiveNumber);
  app.add_option("--sp-scheme", a.sp_scheme, "with --sp: the K/V exchange projected: allgather (the default: every "
                 "rank holds a layer's whole K/V) or ring (each rank its own; the blocks go round)")
      ->transform(CLI::CheckedTransformer(std::map<std::string, SequenceScheme>{{"allgather", SequenceScheme::allgather},
                                                                                {"ring", SequenceScheme::ring}}));
  app.add_option("--host-bytes-per-node", a.host_bytes_per_node, "with --sp and --offload: the host memory of a node "
                 "of 8 devices; a T whose offload tier does not fit it is host-bound")
      ->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--disk-bytes-per-node", a.disk_bytes_per_node, "with --sp and --offload checkpoints: node-local "
                 "disk (NVMe) of a node of 8 devices for the checkpoints the host cannot hold, whole layers, the last "
                 "ones first; 0 = no disk tier (the default)")
      ->capture_default_str();
  app.add_option("--disk-read-bandwidth", a.disk_read_bandwidth, "with --disk-bytes-per-node: the node's disk read "
                 "rate in bytes/s, shared by its 8 devices; a layer's checkpoints read back are timed against its "
                 "backward's compute (the stall factor)")
      ->capture_default_str();
  app.add_option("--device-flops", a.device_flops, "with --disk-bytes-per-node: the device's FLOP/s for the "
                 "backward's compute (default 989e12, an H100 SXM's dense bf16 peak: a real step's lower rate makes "
                 "the stall smaller, so the default is the disk's worst case)")
      ->capture_default_str();
  add_pack_option(app, a.pack);
  add_output_options(app, a.output, "results folder");
}

namespace {

// The paper's Table 4 as a projection: per rank of N GPUs at ZeRO stage `zero` (the models' data-parallel terms,
// NCCL's collectives: no backend copies), the largest T of one sequence per GPU under the budget.
int project_data_parallel(const ProjectArgs& a, const std::string& command_line,
                          const std::map<std::string, ErrorRange>& errors, const std::vector<std::string>& error_dirs) {
  const int zero = a.zero;
  OptimizerFlags flags = a.optimizer;
  if (flags.spec.empty()) flags.spec = "adamw";  // the paper's Table 4 trains
  const auto optimizer = *flags.options();
  const std::string optimizer_column = flags.describe();
  const std::vector<std::pair<std::string, std::string>> methods = {
      {"checkpoint", "checkpoint"}, {"streambp", "streambp:layer_chunk=500,head_chunk=100"}};
  const auto config = preset_config("qwen3-8b");
  auto objective = make_objective("sft");
  fmt::print("Table 4, projected by the analytic memory models per rank: Qwen3-8B full training, bf16, SFT, one "
             "sequence per GPU, {} GPUs of {:.0f} GB, {}\n"
             "training steps: {} (states and the update's temporaries in the budget{})\n"
             "collectives: NCCL's (no backend copies of their buffers); kernel workspaces: {}\n",
             fmt::join(a.world_sizes, "/"), double(a.budget_bytes) / 1e9, zero == 0 ? "DDP" : fmt::format("ZeRO-{}", zero),
             optimizer_column, zero >= 1 ? ", sharded" : "", no_kernel_workspaces()->source());
  if (!error_dirs.empty())
    fmt::print("error bar: T* under budget / max(measured/model) .. budget / min(measured/model), over the CPU runs "
               "in {} whose preset starts with '{}'\n", fmt::join(error_dirs, ", "), a.error_presets);
  if (zero != 2) fmt::print("(the paper's Table 4 is ZeRO-2: its numbers are printed only beside --zero 2)\n");
  fmt::print("\n| GPUs | method | projected T* | error bar | paper T* | projected / paper | per-rank peak at T* |\n"
             "|---|---|---|---|---|---|---|\n");
  ResultsTable table({"objective", "optimizer", "world_size", "zero", "batch_size", "budget_bytes", "model_max_seq",
                      "model_max_seq_low", "model_max_seq_high", "error_runs", "paper_max_seq", "model_over_paper",
                      "peak_moment", "pack"});
  for (const int n : a.world_sizes)
    for (const auto& [label, spec] : methods) {
      auto w = paper_workload(config, false, a.lora_rank, *objective, 1);
      w.add(DataParallelism{.world_size = n, .zero_stage = zero, .collective_copies = false});  // NCCL
      add_projected_optimizer(w, optimizer);
      double paper = 0;
      for (std::size_t i = 0; i < std::size(kPaperTable4Gpus); ++i)
        if (zero == 2 && kPaperTable4Gpus[i] == n)
          paper = 1000 * (label == "checkpoint" ? kPaperTable4Checkpoint[i] : kPaperTable4StreamBP[i]);
      auto method = make_method(spec);
      const auto [T, low, high, bar, runs] = project_max_seq(*method, w, a.budget_bytes, errors, label, a.pack);
      w.seq_len = std::max<std::int64_t>(T, 1);
      pack_workload(w, a.pack, 0);
      const auto at_max = training_memory(*method, w);
      fmt::print("| {} | {} | {:.1f}k | {} | {} | {} | {:.1f} GB at {} |\n", n, method->spec(), T / 1000.0, bar,
                 paper > 0 ? fmt::format("{:.1f}k", paper / 1000.0) : "-",
                 paper > 0 ? fmt::format("{:.2f}", T / paper) : "-", double(at_max.total_bytes()) / 1e9, at_max.moment);
      table.add({"qwen3-8b", method->spec(), "bf16", "projection", 0,
                 {objective->spec(), optimizer_column, std::to_string(n), std::to_string(zero), "1",
                  std::to_string(a.budget_bytes), std::to_string(T), low, high, runs, paper > 0 ? fmt::format("{:.0f}", paper) : "",
                  paper > 0 ? fmt::format("{:.4f}", T / paper) : "", at_max.moment, a.pack.packed() ? a.pack.spec() : ""}});
    }
  fmt::print("\n");
  const auto csv = table.write(a.output.out_dir, "project-zero", collect_provenance(command_line));
  fmt::print("results: {}\n", std::filesystem::absolute(csv).string());
  return 0;
}

}  // namespace

int project_command(const ProjectArgs& a, const std::string& command_line) {
  const std::vector<std::pair<std::string, std::string>> methods = {{"standard", "standard"},
                                                                    {"checkpoint", "checkpoint"},
                                                                    {"mst", "mst"},
                                                                    {"streambp", "streambp:layer_chunk=500,head_chunk=100"}};
  // The error bars' runs: --errors, else results/grid here, else the harness's own (run from anywhere).
  auto error_dirs = a.error_dirs;
  const std::vector<std::string> default_dirs = {"results/grid", harness_path("results/grid")};
  if (error_dirs.empty())
    for (const auto& dir : default_dirs)
      if (std::filesystem::is_directory(dir)) {
        error_dirs.push_back(dir);
        break;
      }
  const auto errors = measured_errors(error_dirs, a.error_presets);
  for (const int n : a.world_sizes)
    if (n < 1) throw InputError("--world " + std::to_string(n) + ": a world size is at least 1 GPU");
  if (a.zero < 0 || a.zero > 3)
    throw InputError("--zero " + std::to_string(a.zero) + ": a ZeRO stage is 0 (DDP), 1, 2 or 3");
  if (a.zero > 0 && a.world_sizes.empty())
    throw InputError("--zero " + std::to_string(a.zero) + " needs --world N (the GPUs of the data-parallel "
                                "run, e.g. --world 3,4,5,6,7,8)");
  if (a.sp == 0 && a.sp_scheme != SequenceScheme::allgather)
    throw InputError("--sp-scheme needs --sp N (the projection of a sequence split over N devices)");
  if (a.pack.packed() && (a.sp > 0 || !a.offload.kinds.empty()))
    throw InputError(std::string("--pack with ") + (a.sp > 0 ? "--sp" : "--offload") + ": packed rows are projected "
                     "for Table 3 and --world only");
  // CLI11's range checks let NaN and Inf through: a byte count or a rate must be a finite number.
  // (--host-bytes-per-node nan made every row host-bound at T = 0 and ended in an internal error.)
  for (const auto& [flag, x, positive] :
       {std::tuple{"--disk-bytes-per-node", a.disk_bytes_per_node, false},
        {"--disk-read-bandwidth", a.disk_read_bandwidth, false}, {"--device-flops", a.device_flops, true},
        {"--host-bytes-per-node", a.host_bytes_per_node, true}})
    if (!std::isfinite(x) || x < 0 || (x == 0 && positive))
      throw InputError(fmt::format("{} {}: not a finite {} number", flag, x, positive ? "positive" : "non-negative"));
  if (a.disk_bytes_per_node > 0 && (a.sp == 0 || !a.offload.checkpoints()))
    throw InputError("--disk-bytes-per-node needs --sp N and --offload with checkpoints (the disk tier holds the "
                     "offloaded checkpoints the host cannot)");
  if (a.disk_bytes_per_node > 0 && !(a.disk_read_bandwidth > 0))
    throw InputError("--disk-read-bandwidth: a disk tier (--disk-bytes-per-node) needs its read rate in bytes/s, "
                     "e.g. 2.5e10");
  if (a.disk_bytes_per_node == 0 && a.disk_read_bandwidth > 0)
    throw InputError("--disk-read-bandwidth needs --disk-bytes-per-node (the disk tier it times)");
  if (a.sp > 0) return project_sequence_parallel(a, command_line);
  if (a.nproc > 0) throw InputError("--nproc " + std::to_string(a.nproc) + " needs --sp N");
  if (!a.world_sizes.empty()) return project_data_parallel(a, command_line, errors, error_dirs);
  if (!a.offload.kinds.empty()) return project_offload(a, command_line);
  const auto optimizer = a.optimizer.options();
  const std::string optimizer_column = a.optimizer.describe();
  ResultsTable table({"objective", "lora", "optimizer", "batch_size", "budget_bytes", "model_max_seq", "model_max_seq_low",
                      "model_max_seq_high", "error_runs", "paper_max_seq", "model_over_paper", "pack"});
  fmt::print("Table 3, projected by the analytic memory models: maximum T under {:.0f} GB, bf16 (LoRA: fp32 adapters)\n"
             "kernel workspaces: {} (a GPU's cuBLAS/flash workspaces are not modelled; this CPU's calibration would not "
             "describe them)\n",
             double(a.budget_bytes) / 1e9, no_kernel_workspaces()->source());
  fmt::print("{}\n", optimizer ? "training steps: " + optimizer_column + " (states and the update's temporaries in the budget)"
                              : "forward + backward only (no optimizer state; --optimizer adamw projects training)");
  if (error_dirs.empty())
    fmt::print("no error bars: no measured runs in {} or {} (give --errors DIR, or run `streambp reproduce "
               "memory-grid`)\n\n", default_dirs[0], default_dirs[1]);
  else
    fmt::print("error bar: T* under budget / max(measured/model) .. budget / min(measured/model), over the CPU runs "
               "in {} whose preset starts with '{}'\n\n", fmt::join(error_dirs, ", "), a.error_presets);
  if (a.pack.packed())
    fmt::print("packed rows: each T's row filled with sequences of --pack {} (seed 0); SFT only (Table 3's GRPO rows "
               "are a padded group of 8; DPO refuses packed rows)\n\n", a.pack.spec());
  for (const auto& o : kObjectives) {
    auto objective = make_objective(o.spec);
    // Packed projections are SFT's: Table 3's GRPO rows are one padded group per step, its DPO rows pairs.
    if (a.pack.packed() && objective->name() != "sft") continue;
    const std::string name = o.spec;
    fmt::print("### {} (B = {}{})\n\n", name, o.batch, name == "grpo" ? ", a group of 8" : name == "dpo" ? ": one pair" : "");
    if (name == "grpo") fmt::print("paper (columns unlabelled): {}\n\n", kPaperGrpo);
    if (name == "dpo") fmt::print("paper (columns unlabelled): {}\n\n", kPaperDpo);
    fmt::print("| model | method | projected T* | error bar | paper T* | projected / paper |\n|---|---|---|---|---|---|\n");
    for (const auto& s : kSettings) {
      const auto config = preset_config(s.preset);
      auto w = paper_workload(config, s.lora, a.lora_rank, *objective, o.batch);
      if (optimizer) add_projected_optimizer(w, *optimizer);
      const std::string model_name = std::string(s.preset) + (s.lora ? " LoRA" : " full");
      for (const auto& [label, spec] : methods) {
        const double paper = name != "sft" || label == "mst" ? 0
                             : 1000 * (label == "standard" ? s.standard : label == "checkpoint" ? s.checkpoint : s.streambp);
        auto method = make_method(spec);
        const auto [T, low, high, bar, runs] = project_max_seq(*method, w, a.budget_bytes, errors, label, a.pack);
        fmt::print("| {} | {} | {:.1f}k | {} | {} | {} |\n", model_name, method->spec(), T / 1000.0, bar,
                   paper > 0 ? fmt::format("{:.1f}k", paper / 1000.0) : "-", paper > 0 ? fmt::format("{:.2f}", T / paper) : "-");
        table.add({s.preset, method->spec(), s.lora ? "bf16-mixed" : "bf16", "projection", 0,
                   {objective->spec(), s.lora ? fmt::format("rank={},targets=all-linear", a.lora_rank) : "",
                    optimizer_column, std::to_string(o.batch), std::to_string(a.budget_bytes), std::to_string(T), low, high,
                    runs,
                    paper > 0 ? fmt::format("{:.0f}", paper) : "", paper > 0 ? fmt::format("{:.4f}", T / paper) : "",
                    a.pack.packed() ? a.pack.spec() : ""}});
      }
    }
    fmt::print("\n");
  }
  const auto csv = table.write(a.output.out_dir, "project", collect_provenance(command_line));
  fmt::print("results: {}\n", std::filesystem::absolute(csv).string());
  return 0;
}

}  // namespace sbp
