// `streambp project --sp N [--nproc M] [--offload KINDS]`: StreamBP with sequence parallelism (ARCHITECTURE.md §16)
// beside ALST's multi-GPU maxima (arXiv 2506.13996: Llama-3.1-8B, full-parameter SFT with AdamW, Ulysses sequence
// parallelism with ZeRO-3 and offload: 3.7M tokens on 8 H100-80GB, 15M on 32). Per rank of M devices of --budget-bytes,
// each sequence over N of them, ZeRO-3 over all M (ALST's setting), NCCL, with every combination of the offload kinds
// asked for: the projected T*, the device's bytes there and every term of the rank's peak, and what stops a longer T.
#include <cstdint>
#include <filesystem>
#include <string>

#include <fmt/format.h>

#include "baselines/methods.h"
#include "core/model/config.h"
#include "core/objectives/objective.h"
#include "core/training/training_memory.h"
#include "experiments/commands.h"
#include "experiments/projection.h"
#include "experiments/results_table.h"
#include "core/io/input_error.h"

namespace sbp {
namespace {

// ALST's published sequence-parallel maxima by device count (its run configs set 3.8M and 15.5M).
double alst_tokens(int devices) { return devices == 8 ? 3.7e6 : devices == 32 ? 15e6 : 0; }

// The terms of a rank's peak that grow with the whole sequence, not with its shard: the gathered K/V, their
// gradients' fp32 sums and the exchange's buffers (MemoryTerm::whole_sequence).
std::int64_t whole_sequence_bytes(const MemoryEstimate& e) {
  std::int64_t n = 0;
  for (const auto& t : e.terms)
    if (t.whole_sequence) n += t.bytes;
  return n;
}

}  // namespace

int project_sequence_parallel(const ProjectArgs& a, const std::string& command_line) {
  const int sp = a.sp, world = a.nproc > 0 ? a.nproc : a.sp;
  if (sp < 2) throw InputError("--sp " + std::to_string(sp) + ": a sequence is split over at least 2 ranks");
  if (world % sp != 0)
    throw InputError(fmt::format("--sp {} --nproc {}: {} ranks do not form groups of {}", sp, world, world, sp));
  const std::string spec = "streambp:layer_chunk=500,head_chunk=100";
  auto method = make_method(spec);
  auto objective = make_objective("sft");
  const auto budget = a.budget_bytes - a.gpu_floor_bytes;
  fmt::print("StreamBP with sequence parallelism beside ALST: per rank of {} devices of {:.0f} GB, each sequence over "
             "{} (all-gather context parallelism, zig-zag split), ZeRO-3 over all {}, full-parameter SFT with AdamW in "
             "bf16, one sequence per sequence-parallel group, projected by the analytic memory models (NCCL: no "
             "collective copies)\nGPU floor: {:.1f} GB taken off every budget (assumed, --gpu-floor-bytes)\n\n",
             world, a.budget_bytes / 1e9, sp, world, a.gpu_floor_bytes / 1e9);
  fmt::print("| model | offload | projected T* | device at T* | of it, growing with the whole sequence | peak at | tier "
             "at T* |\n|---|---|---|---|---|---|---|\n");
  ResultsTable table({"objective", "optimizer", "world_size", "sequence_parallel", "zero", "budget_bytes", "gpu_floor_bytes",
                      "offload", "model_max_seq", "device_bytes", "whole_sequence_bytes", "host_bytes", "peak_moment"});
  std::int64_t best = 0;
  MemoryEstimate best_peak;
  std::string best_what;
  for (const std::string preset : {"llama-3.1-8b", "qwen3-8b"})
    for (const auto& offload : offload_sets(a.offload)) {
      auto w = alst_workload(preset_config(preset), *objective, offload, world, 3, sp);
      const auto T = max_projected_seq(*method, w, budget, 2 * sp);
      w.seq_len = std::max<std::int64_t>(T, 2 * sp);
      const auto peak = training_memory(*method, w);
      fmt::print("| {} | {} | {:.2f}M | {:.1f} GB | {:.1f} GB | {} | {:.1f} GB |\n", preset,
                 offload.name().empty() ? "-" : offload.name(), T / 1e6, peak.total_bytes() / 1e9,
                 whole_sequence_bytes(peak) / 1e9, peak.moment, peak.host_bytes() / 1e9);
      table.add({preset, spec, "bf16", "projection", 0,
                 {objective->spec(), "adamw", std::to_string(world), std::to_string(sp), "3", std::to_string(a.budget_bytes),
                  std::to_string(a.gpu_floor_bytes), offload.name(), std::to_string(T),
                  std::to_string(peak.total_bytes()), std::to_string(whole_sequence_bytes(peak)),
                  std::to_string(peak.host_bytes()), peak.moment}});
      if (preset == std::string("llama-3.1-8b") && T > best) {
        best = T;
        best_peak = peak;
        best_what = offload.name().empty() ? "no offload" : "offload of " + offload.name();
      }
    }
  fmt::print("\nLlama-3.1-8B's best ({}), the rank's peak at T* = {:.2f}M ({}), term by term:\n\n| term | bytes |\n|---|---|\n",
             best_what, best / 1e6, best_peak.moment);
  for (const auto& t : best_peak.terms)
    if (t.bytes > 0) fmt::print("| {} | {:.2f} GB |\n", t.name, t.bytes / 1e9);
  const double alst = alst_tokens(world);
  const auto whole = whole_sequence_bytes(best_peak);
  const double per_position = best > 0 ? double(whole) / double(best) : 0;
  fmt::print("\nALST, measured (Llama-3.1-8B, Ulysses SP with ZeRO-3, optimizer and checkpoints offloaded, tiled MLP "
             "and fused logits loss): 3.7M tokens on 8 H100-80GB, 15M on 32.\n");
  if (alst > 0)
    fmt::print("Goal (issue #32): at least 2x ALST on {} devices, {:.1f}M. Projected: {:.2f}M ({:.2f}x ALST).\n",
               world, 2 * alst / 1e6, best / 1e6, best / alst);
  fmt::print("What stops a longer T: every rank holds the whole sequence's K/V, their fp32 gradient sums and the "
             "exchange's buffers for one layer at a time, {:.1f} KB per position of the whole sequence ({:.1f} GB of "
             "the rank's {:.1f} GB at T*), whatever N; the rest shrinks with N. The long end needs the exchange "
             "streamed rank by rank (a ring over key blocks, each rank holding one block of K/V and dK/dV at a time), "
             "which is not built.\n\n",
             per_position / 1e3, whole / 1e9, best_peak.total_bytes() / 1e9);
  const auto csv = table.write(a.output.out_dir, fmt::format("project-sp{}-nproc{}", sp, world),
                               collect_provenance(command_line));
  fmt::print("results: {}\n", std::filesystem::absolute(csv).string());
  return 0;
}

}  // namespace sbp
