// `streambp project --sp N [--nproc M] [--offload KINDS] [--sp-scheme allgather|ring]`: StreamBP with sequence
// parallelism (ARCHITECTURE.md §16) beside the published long-context maxima for Llama-3.1-8B, full-parameter SFT with
// AdamW: ALST (arXiv 2506.13996; Ulysses with ZeRO-3 and offload) 3.7M tokens on 8 H100-80GB and 15M on 32, UPipe
// (headwise-chunked Ulysses, 2026) 5M on 8. Per rank of M devices of --budget-bytes, each sequence over N of them,
// ZeRO-3 over all M (ALST's setting), NCCL, with every combination of the offload kinds asked for: the T the device
// allows, the T the host allows (the offload tier's bytes per node of 8 devices within a real node's memory), the
// smaller of the two, every term of the rank's peak, and what stops a longer T.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>

#include <fmt/format.h>

#include "baselines/methods.h"
#include "core/model/config.h"
#include "core/objectives/objective.h"
#include "core/training/sequence_scheme.h"
#include "core/training/training_memory.h"
#include "experiments/commands.h"
#include "experiments/projection.h"
#include "experiments/results_table.h"
#include "core/io/input_error.h"

namespace sbp {
namespace {

// The anchors (Llama-3.1-8B, full SFT, measured on 80 GB devices; 0: none published at that count). ALST's run
// configs set 3.8M and 15.5M; UPipe reports 5M on 8.
double alst_tokens(int devices) { return devices == 8 ? 3.7e6 : devices == 32 ? 15e6 : 0; }
double upipe_tokens(int devices) { return devices == 8 ? 5e6 : 0; }
// Issue #48's goal: twice the best anchor at that device count (10M on 8, 30M on 32).
double goal_tokens(int devices) { return 2 * std::max(alst_tokens(devices), upipe_tokens(devices)); }

// The offload tier lives in host memory: a projection counts only while a node of 8 devices holds it
// (--host-bytes-per-node, 2 TB: ALST's machines had 1.9 TB per 8 H100s).
constexpr int kDevicesPerNode = 8;

// The terms of a rank's peak that grow with the whole sequence, not with its shard: the all-gather's K/V, their
// gradients' fp32 sums and its buffers (MemoryTerm::whole_sequence; the ring has none).
std::int64_t whole_sequence_bytes(const MemoryEstimate& e) {
  std::int64_t n = 0;
  for (const auto& t : e.terms)
    if (t.whole_sequence) n += t.bytes;
  return n;
}

// What each term of `at` costs per position of the whole sequence, from the same term (by name) of `before`, the
// estimate at a shorter T: the terms that stop a longer T, largest first (a term constant in T costs 0).
std::vector<std::pair<std::string, double>> bytes_per_position(const std::vector<MemoryTerm>& at, std::int64_t T,
                                                               const std::vector<MemoryTerm>& before,
                                                               std::int64_t T_before) {
  std::map<std::string, std::int64_t> earlier;
  for (const auto& t : before) earlier[t.name] += t.bytes;
  std::map<std::string, std::int64_t> now;
  for (const auto& t : at) now[t.name] += t.bytes;
  std::vector<std::pair<std::string, double>> out;
  for (const auto& [name, bytes] : now) {
    const double slope = double(bytes - earlier[name]) / double(T - T_before);
    if (slope > 0.5) out.push_back({name, slope});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  return out;
}

struct Row {
  std::int64_t device_T = 0, host_T = 0, T = 0;  // host_T 0: the host holds the tier at device_T (no host bound)
  double host_at_device_T = 0;                     // the tier's bytes per node at device_T
  MemoryEstimate peak;
};

}  // namespace

int project_sequence_parallel(const ProjectArgs& a, const std::string& command_line) {
  const int sp = a.sp, world = a.nproc > 0 ? a.nproc : a.sp;
  if (sp < 2) throw InputError("--sp " + std::to_string(sp) + ": a sequence is split over at least 2 ranks");
  if (world % sp != 0)
    throw InputError(fmt::format("--sp {} --nproc {}: {} ranks do not form groups of {}", sp, world, world, sp));
  const std::string spec = "streambp:layer_chunk=500,head_chunk=100";
  const std::string scheme = sequence_scheme_name(a.sp_scheme);
  auto method = make_method(spec);
  auto objective = make_objective("sft");
  const auto budget = a.budget_bytes - a.gpu_floor_bytes;
  const auto nodes_of = [&](const MemoryEstimate& e) { return double(e.host_bytes()) * kDevicesPerNode; };
  fmt::print("StreamBP with sequence parallelism beside ALST and UPipe: per rank of {} devices of {:.0f} GB, each "
             "sequence over {} ({}), ZeRO-3 over all {}, full-parameter SFT with AdamW in bf16, one sequence per "
             "sequence-parallel group, projected by the analytic memory models (NCCL: no collective copies)\n"
             "GPU floor: {:.1f} GB taken off every budget (assumed, --gpu-floor-bytes); host: the offload tier of {} "
             "devices within {:.1f} TB (a node like ALST's)\n\n",
             world, a.budget_bytes / 1e9, sp,
             a.sp_scheme == SequenceScheme::ring ? "a ring over key blocks" : "all-gather context parallelism, zig-zag split",
             world, a.gpu_floor_bytes / 1e9, kDevicesPerNode, a.host_bytes_per_node / 1e12);
  fmt::print("| model | offload | device-bound T | host-bound T | projected T* | device at T* | of it, growing with the "
             "whole sequence | peak at | host per node of {} at T* |\n|---|---|---|---|---|---|---|---|---|\n",
             kDevicesPerNode);
  ResultsTable table({"objective", "optimizer", "world_size", "sequence_parallel", "sp_scheme", "zero", "budget_bytes",
                      "gpu_floor_bytes", "offload", "model_max_seq", "device_max_seq", "host_max_seq", "device_bytes",
                      "whole_sequence_bytes", "host_bytes", "host_bytes_per_node", "peak_moment"});
  Row best;
  Workload best_workload;
  std::string best_what;
  for (const std::string preset : {"llama-3.1-8b", "qwen3-8b"})
    for (const auto& offload : offload_sets(a.offload)) {
      auto w = alst_workload(preset_config(preset), *objective, offload, world, 3, sp, a.sp_scheme);
      Row r;
      r.device_T = max_projected_seq(*method, w, budget, 2 * sp);
      r.T = r.device_T;
      w.seq_len = std::max<std::int64_t>(r.device_T, 2 * sp);
      r.host_at_device_T = nodes_of(training_memory(*method, w));
      if (r.host_at_device_T > a.host_bytes_per_node) {
        r.host_T = max_projected_seq_where(*method, w, 2 * sp,
                                           [&](const MemoryEstimate& e) { return nodes_of(e) <= a.host_bytes_per_node; });
        r.T = std::min(r.device_T, r.host_T);
      }
      w.seq_len = std::max<std::int64_t>(r.T, 2 * sp);
      r.peak = training_memory(*method, w);
      const auto host_T = r.host_T > 0 ? fmt::format("{:.2f}M", r.host_T / 1e6) : std::string("-");
      fmt::print("| {} | {} | {:.2f}M | {} | {:.2f}M | {:.1f} GB | {:.1f} GB | {} | {:.2f} TB |\n", preset,
                 offload.name().empty() ? "-" : offload.name(), r.device_T / 1e6, host_T, r.T / 1e6,
                 r.peak.total_bytes() / 1e9, whole_sequence_bytes(r.peak) / 1e9, r.peak.moment,
                 nodes_of(r.peak) / 1e12);
      table.add({preset, spec, "bf16", "projection", 0,
                 {objective->spec(), "adamw", std::to_string(world), std::to_string(sp), scheme, "3",
                  std::to_string(a.budget_bytes), std::to_string(a.gpu_floor_bytes), offload.name(),
                  std::to_string(r.T), std::to_string(r.device_T), r.host_T > 0 ? std::to_string(r.host_T) : "",
                  std::to_string(r.peak.total_bytes()), std::to_string(whole_sequence_bytes(r.peak)),
                  std::to_string(r.peak.host_bytes()), fmt::format("{:.0f}", nodes_of(r.peak)), r.peak.moment}});
      if (preset == std::string("llama-3.1-8b") && r.T > best.T) {
        best = r;
        best_workload = w;
        best_what = offload.name().empty() ? "no offload" : "offload of " + offload.name();
      }
    }
  fmt::print("\nLlama-3.1-8B's best ({}), the rank's peak at T* = {:.2f}M ({}), term by term:\n\n| term | bytes |\n"
             "|---|---|\n", best_what, best.T / 1e6, best.peak.moment);
  for (const auto& t : best.peak.terms)
    if (t.bytes > 0) fmt::print("| {} | {:.2f} GB |\n", t.name, t.bytes / 1e9);
  const double alst = alst_tokens(world), upipe = upipe_tokens(world);
  const auto ratio = [&](double anchor) { return anchor > 0 ? fmt::format("{:.2f}x", best.T / anchor) : std::string("-"); };
  fmt::print("\n| Llama-3.1-8B on {} devices | tokens | StreamBP ({}) against it |\n|---|---|---|\n", world, scheme);
  fmt::print("| StreamBP, projected ({}) | {:.2f}M | |\n", best_what, best.T / 1e6);
  fmt::print("| ALST, measured (Ulysses SP, ZeRO-3, offload, tiled MLP, fused loss) | {} | {} |\n",
             alst > 0 ? fmt::format("{:.1f}M", alst / 1e6) : "not published", ratio(alst));
  fmt::print("| UPipe, measured (headwise-chunked Ulysses) | {} | {} |\n",
             upipe > 0 ? fmt::format("{:.1f}M", upipe / 1e6) : "not published", ratio(upipe));
  if (const double goal = goal_tokens(world); goal > 0)
    fmt::print("\nGoal (issue #48): at least twice the best anchor on {} devices, {:.0f}M: {} (projected {:.2f}M).\n",
               world, goal / 1e6, best.T >= goal ? "met" : "not met", best.T / 1e6);
  // What stops a longer T: the bound that binds, and its terms by their cost per position of the whole sequence (the
  // same terms at 90% of T*).
  const bool host_bound = best.host_T > 0 && best.host_T < best.device_T;
  auto shorter = best_workload;
  shorter.seq_len = std::max<std::int64_t>(2 * sp, best.T / 10 * 9 / (2 * sp) * (2 * sp));
  const auto before = training_memory(*method, shorter);
  const auto stops = host_bound ? bytes_per_position(best.peak.host, best.T, before.host, shorter.seq_len)
                                : bytes_per_position(best.peak.terms, best.T, before.terms, shorter.seq_len);
  double per_position = 0;
  for (const auto& [name, bytes] : stops) per_position += bytes;
  if (best.T > kProjectionCeiling - 2 * sp)
    fmt::print("What stops a longer T: nothing the models hold below {:.2f}M positions, where the search stops; per "
               "rank the device's peak grows by {:.1f} KB per position of the whole sequence there:\n",
               best.T / 1e6, per_position / 1e3);
  else if (host_bound)
    fmt::print("What stops a longer T: the host. The offload tier holds {:.2f} TB per node of {} devices at the device's "
               "T* of {:.2f}M, beyond {:.1f} TB; per rank it grows by {:.1f} KB per position of the whole sequence:\n",
               best.host_at_device_T / 1e12,
               kDevicesPerNode, best.device_T / 1e6, a.host_bytes_per_node / 1e12, per_position / 1e3);
  else
    fmt::print("What stops a longer T: the device ({:.1f} of {:.1f} GB at T*); per rank its peak grows by {:.1f} KB per "
               "position of the whole sequence:\n", best.peak.total_bytes() / 1e9, budget / 1e9, per_position / 1e3);
  fmt::print("\n| term | bytes per position of the whole sequence, per rank |\n|---|---|\n");
  for (const auto& [name, bytes] : stops) fmt::print("| {} | {:.1f} |\n", name, bytes);
  fmt::print("\n");
  const auto csv = table.write(a.output.out_dir, fmt::format("project-sp{}-nproc{}-{}", sp, world, scheme),
                               collect_provenance(command_line));
  fmt::print("results: {}\n", std::filesystem::absolute(csv).string());
  return 0;
}

}  // namespace sbp
