// `streambp project --offload KINDS`: the memory models beside Arctic Long Sequence Training (ALST, arXiv 2506.13996),
// the longest exact single-device training published: Llama-3.1-8B and Qwen3-8B, full-parameter SFT with AdamW (pure
// bf16: bf16 weights, gradients and states, the paper's full training), one sequence, on one 80 GB and one 141 GB
// device. Rows: every method that keeps checkpoints, without offload and with every combination of the kinds asked for
// (checkpoints, gradients, the optimizer's states, the parameters), with the device's and the tier's bytes at the projected maximum T. The update's
// temporaries are counted on the device (an upper bound where the states are offloaded: a GPU's update then runs on
// the host). A GPU holds things the CPU calibration cannot see (the CUDA context, cuBLAS and flash workspaces, the
// caching allocator's fragmentation): one named term, --gpu-floor-bytes, taken off the budget and printed in every
// row, never folded into a method's model.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "baselines/methods.h"
#include "core/model/config.h"
#include "core/objectives/objective.h"
#include "core/training/optimizer_shard.h"
#include "core/training/training_memory.h"
#include "experiments/commands.h"
#include "experiments/projection.h"
#include "experiments/results_table.h"

namespace sbp {
namespace {

// ALST's published maxima (its run-h100/h200-sp1-llama-8b configs) and its H200 ablation (max length, GPU peak).
struct AlstRow {
  const char* setting;
  double max_tokens, peak_gb;
};
constexpr AlstRow kAlstH200Ablation[] = {{"baseline", 65e3, 137},
                                         {"+ fused logits loss", 300e3, 135},
                                         {"+ checkpoint offload", 650e3, 127},
                                         {"+ tiled MLP", 1.2e6, 136}};
constexpr double kAlstH100 = 500e3, kAlstH200 = 1.2e6;

struct Device {
  const char* name;
  std::int64_t bytes;
};
constexpr Device kDevices[] = {{"H100-80GB", 80'000'000'000}, {"H200-141GB", 141'000'000'000}};

// The methods that keep checkpoints: checkpointing (HF's), MsT with mini-sequences of about the hidden size at these
// lengths (ALST's tiled MLP and fused loss shard by ceil(T / hidden)), StreamBP at the paper's partition.
const std::vector<std::string> kMethods = {"checkpoint", "mst:mini_seq=256", "streambp:layer_chunk=500,head_chunk=100"};

}  // namespace

int project_offload(const ProjectArgs& a, const std::string& command_line) {
  const auto sets = offload_sets(a.offload);
  auto objective = make_objective("sft");
  fmt::print("Beside ALST: the longest sequence of full-parameter SFT with AdamW on one device, projected by the "
             "analytic memory models (bf16 weights, gradients and AdamW states: on the device unless offloaded; one "
             "sequence)\n"
             "GPU floor: {:.1f} GB taken off every budget (CUDA context, cuBLAS/flash workspaces, allocator "
             "fragmentation: assumed, --gpu-floor-bytes; no GPU here measures it)\n\n",
             double(a.gpu_floor_bytes) / 1e9);
  fmt::print("| model | device | method | offload | projected T* | device at T* | device at T = 1 (what does not grow "
             "with T) | per 1K tokens on the device | tier at T* |\n|---|---|---|---|---|---|---|---|---|\n");
  ResultsTable table({"objective", "optimizer", "device", "budget_bytes", "gpu_floor_bytes", "offload", "model_max_seq",
                      "device_bytes", "fixed_bytes", "device_bytes_per_token", "host_bytes", "peak_moment"});
  std::int64_t best_8b_80 = 0;
  std::string best_what, stop;
  for (const std::string preset : {"llama-3.1-8b", "qwen3-8b"})
    for (const auto& device : kDevices)
      for (const auto& spec : kMethods)
        for (const auto& offload : sets) {
          const auto config = preset_config(preset);
          auto method = make_method(spec);
          auto w = alst_workload(config, *objective, offload);
          const auto budget = device.bytes - a.gpu_floor_bytes;
          const auto T = max_projected_seq(*method, w, budget);
          w.seq_len = std::max<std::int64_t>(T, 1);
          const auto at_max = training_memory(*method, w);
          // What does not grow with T, and what does per token (between T/2 and T, where the terms are linear).
          w.seq_len = 1;
          const auto fixed = training_memory(*method, w).total_bytes();
          w.seq_len = std::max<std::int64_t>(T / 2, 1);
          const auto half = training_memory(*method, w).total_bytes();
          const double per_token = T > 2 ? double(at_max.total_bytes() - half) / double(T - T / 2) : 0;
          fmt::print("| {} | {} | {} | {} | {:.0f}K | {:.1f} GB | {:.1f} GB | {:.1f} MB | {:.1f} GB |\n", preset, device.name,
                     method->spec(), offload.name().empty() ? "-" : offload.name(), T / 1000.0, at_max.total_bytes() / 1e9, fixed / 1e9,
                     per_token * 1000 / 1e6, at_max.host_bytes() / 1e9);
          table.add({preset, method->spec(), "bf16", "projection", 0,
                     {objective->spec(), "adamw", device.name, std::to_string(device.bytes),
                      std::to_string(a.gpu_floor_bytes), offload.name(), std::to_string(T),
                      std::to_string(at_max.total_bytes()), std::to_string(fixed), fmt::format("{:.1f}", per_token),
                      std::to_string(at_max.host_bytes()), at_max.moment}});
          if (preset == std::string("llama-3.1-8b") && device.bytes == 80'000'000'000 && T > best_8b_80) {
            best_8b_80 = T;
            best_what = method->spec() + (offload.name().empty() ? "" : " + offload of " + offload.name());
            stop = fmt::format("{:.1f} GB of the {:.1f} GB left after the floor do not depend on T (what of the weights, "
                               "gradients and AdamW states is on the device), and each 1K tokens costs {:.1f} MB there",
                               fixed / 1e9, budget / 1e9, per_token * 1000 / 1e6);
          }
        }
  fmt::print("\nALST, measured (Llama-3.1-8B, ZeRO-3 with parameters and optimizer on the CPU, checkpoints offloaded, "
             "tiled MLP and fused logits loss): {:.0f}K on one H100-80GB, {:.1f}M on one H200. Its H200 ablation:\n\n"
             "| setting | max length | GPU peak |\n|---|---|---|\n", kAlstH100 / 1e3, kAlstH200 / 1e6);
  for (const auto& r : kAlstH200Ablation)
    fmt::print("| {} | {:.0f}K | {:.0f} GB |\n", r.setting, r.max_tokens / 1e3, r.peak_gb);
  const double goal = 1e6;
  fmt::print("\nGoal (issue #31): StreamBP + offload at >= 1M tokens for an 8B model on one 80 GB device (2x ALST's "
             "500K). Best here for Llama-3.1-8B on 80 GB: {:.0f}K ({}); {}.\n", best_8b_80 / 1e3, best_what, stop);
  if (best_8b_80 < goal)
    fmt::print("Short of the goal by {:.0f}K: what stays on the device does not depend on T; moving what of the "
               "gradients, states and parameters is still there to the tier is what remains.\n",
               (goal - double(best_8b_80)) / 1e3);
  else
    fmt::print("The goal is met on paper: {:.1f}x ALST's 500K. A GPU run has not measured it (tests/gpu/run.sh step 9 "
               "checks the tier's copies; no GPU here).\n", double(best_8b_80) / kAlstH100);
  fmt::print("\n");
  const auto csv = table.write(a.output.out_dir, "project-offload", collect_provenance(command_line));
  fmt::print("results: {}\n", std::filesystem::absolute(csv).string());
  return 0;
}

}  // namespace sbp
