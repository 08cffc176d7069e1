// `streambp project --sp N [--nproc M] [--offload KINDS] [--sp-scheme allgather|ring]`: StreamBP with sequence
// parallelism (ARCHITECTURE.md §16) beside the published long-context maxima for Llama-3.1-8B, full-parameter SFT with
// AdamW: ALST (arXiv 2506.13996; Ulysses with ZeRO-3 and offload) 3.7M tokens on 8 H100-80GB and 15M on 32, UPipe
// (headwise-chunked Ulysses, 2026) 5M on 8. Per rank of M devices of --budget-bytes, each sequence over N of them,
// ZeRO-3 over all M (ALST's setting), NCCL, with every combination of the offload kinds asked for: the T the device
// allows, the T the host allows (the offload tier's bytes per node of 8 devices within a real node's memory), the
// smaller of the two, every term of the rank's peak, and what stops a longer T. With --disk-bytes-per-node, a third
// tier: the checkpoints the host cannot hold go to node-local disk, whole layers, and each row says how long a
// disk-held layer's read takes against that layer's backward on the device (the stall factor).
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <variant>

#include <fmt/format.h>

#include "baselines/methods.h"
#include "core/methods/flop_model.h"
#include "core/methods/memory_terms.h"
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

// The disk tier (--disk-bytes-per-node): the checkpoints of layers [k, L) on node-local disk, the host keeping H[0..k).
void set_checkpoint_host_layers(Workload& w, std::int64_t k) {
  for (auto& f : w.features)
    if (auto* o = std::get_if<Offload>(&f); o && o->kind == OffloadKind::checkpoints) o->host_layers = k;
}

// Where a T's offloaded checkpoints go: the host keeps as many whole layers as its budget allows beside the other
// tiers' bytes (the first ones: H[0..k)), the disk the rest. Without a disk tier every one stays on the host.
struct Placement {
  bool fits = false;                    // the host's share within its budget, the disk's within its own
  std::int64_t host_layers = 0;         // k of L
  double host_node = 0, disk_node = 0;  // bytes per node of 8 devices
  std::string bound;                    // when it does not fit: "host" (all it could move is on disk) or "disk"
  MemoryEstimate estimate;
};
Placement place_checkpoints(const BackpropMethod& method, Workload w, const ProjectArgs& a, bool disk_tier) {
  const auto L = w.config.num_hidden_layers;
  Placement p;
  for (auto k = L; k >= 0; --k) {
    set_checkpoint_host_layers(w, k == L ? -1 : k);
    auto e = training_memory(method, w);
    const double host = double(e.host_bytes()) * kDevicesPerNode;
    if (host > a.host_bytes_per_node && disk_tier && k > 0) continue;  // one more layer to the disk
    p.host_layers = k;
    p.host_node = host;
    p.disk_node = double(memory::offload_disk_bytes(w)) * kDevicesPerNode;
    p.fits = host <= a.host_bytes_per_node && p.disk_node <= a.disk_bytes_per_node;
    p.bound = host > a.host_bytes_per_node ? "host" : "disk";
    p.estimate = std::move(e);
    break;
  }
  return p;
}

// The disk's time against the device's in a layer's backward at T (the placement's): a node's 8 ranks read back
// their shards' checkpoint of a disk-held layer at the node's --disk-read-bandwidth while each computes its share of
// the layer's backward (StreamBP's FLOP model over the whole sequence, split evenly over the group: the zig-zag and
// the ring give every rank the same causal share) at --device-flops. 0 when nothing is on disk.
struct Stall {
  double read_seconds = 0, compute_seconds = 0, factor = 0;
  double backward_factor = 1;  // the layers' backward time over the same without the disk: > 1 when it stalls
};
Stall disk_stall(const Workload& w, const Placement& p, const ProjectArgs& a, int sp) {
  const auto L = w.config.num_hidden_layers;
  Stall s;
  if (p.host_layers >= L) return s;
  s.read_seconds = p.disk_node / double(L - p.host_layers) / a.disk_read_bandwidth;
  s.compute_seconds = streambp_layer_backward_flops(w) / sp / a.device_flops;
  s.factor = s.read_seconds / s.compute_seconds;
  s.backward_factor = (double(p.host_layers) + double(L - p.host_layers) * std::max(1.0, s.factor)) / double(L);
  return s;
}

struct Row {
  std::int64_t device_T = 0, host_T = 0, T = 0;  // host_T 0: the host holds the tier at device_T (no host bound)
  double host_at_device_T = 0;                     // the tier's bytes per node at device_T
  MemoryEstimate peak;
  Placement placed;  // at T
  Stall stall;       // at T
  std::string tier_bound;  // host_T's: what a longer T would not fit ("host" or "disk")
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
  const bool disk = a.disk_bytes_per_node > 0;
  if (disk)
    fmt::print("disk: {:.1f} TB of node-local disk per node of {} for the offloaded checkpoints the host cannot hold "
               "(whole layers, the last ones), read back at {:.1f} GB/s per node; a layer's read timed against its "
               "backward on a device of {:.0f} TFLOP/s (StreamBP's FLOP model): stall factor = read / compute, > 1 "
               "when the disk stalls the device (assumed, --disk-bytes-per-node, --disk-read-bandwidth, "
               "--device-flops)\n\n",
               a.disk_bytes_per_node / 1e12, kDevicesPerNode, a.disk_read_bandwidth / 1e9, a.device_flops / 1e12);
  fmt::print("| model | offload | device-bound T | {} | projected T* | device at T* | of it, growing with the "
             "whole sequence | peak at | host per node of {} at T* |{}\n|---|---|---|---|---|---|---|---|---|{}\n",
             disk ? "host+disk-bound T" : "host-bound T", kDevicesPerNode,
             disk ? " on disk per node at T* | stall factor at T* |" : "", disk ? "---|---|" : "");
  std::vector<std::string> columns = {"objective", "optimizer", "world_size", "sequence_parallel", "sp_scheme", "zero",
                                      "budget_bytes", "gpu_floor_bytes", "offload", "model_max_seq", "device_max_seq",
                                      "host_max_seq", "device_bytes", "whole_sequence_bytes", "host_bytes",
                                      "host_bytes_per_node", "peak_moment"};
  if (disk)
    for (const char* c : {"disk_budget_bytes_per_node", "disk_read_bandwidth", "device_flops", "host_layers",
                          "disk_bytes", "disk_bytes_per_node", "layer_read_seconds", "layer_backward_seconds",
                          "stall_factor", "tier_bound"})
      columns.push_back(c);
  ResultsTable table(columns);
  Row best;
  Workload best_workload;
  std::string best_what;
  for (const std::string preset : {"llama-3.1-8b", "qwen3-8b"})
    for (const auto& offload : offload_sets(a.offload)) {
      auto w = alst_workload(preset_config(preset), *objective, offload, world, 3, sp, a.sp_scheme);
      const bool disk_tier = disk && offload.checkpoints;
      const auto placed = [&](const Workload& at) { return place_checkpoints(*method, at, a, disk_tier); };
      Row r;
      r.device_T = max_projected_seq(*method, w, budget, 2 * sp);
      r.T = r.device_T;
      w.seq_len = std::max<std::int64_t>(r.device_T, 2 * sp);
      const auto at_device_T = placed(w);
      r.host_at_device_T = at_device_T.host_node;
      if (!at_device_T.fits) {
        r.host_T = max_projected_seq_of(w, 2 * sp, [&](const Workload& at) { return placed(at).fits; });
        r.T = std::min(r.device_T, r.host_T);
        auto longer = w;
        longer.seq_len = r.host_T + 2 * sp;
        r.tier_bound = placed(longer).bound;
      }
      w.seq_len = std::max<std::int64_t>(r.T, 2 * sp);
      r.placed = placed(w);
      r.peak = r.placed.estimate;
      if (disk_tier) r.stall = disk_stall(w, r.placed, a, sp);
      const auto host_T = r.host_T > 0 ? fmt::format("{:.2f}M", r.host_T / 1e6) : std::string("-");
      const auto L = w.config.num_hidden_layers;
      const auto on_disk = r.placed.host_layers < L
                               ? fmt::format(" {:.2f} TB (H[{}..{}]) | {:.2f} |", r.placed.disk_node / 1e12,
                                             r.placed.host_layers, L - 1, r.stall.factor)
                               : std::string(" - | - |");
      fmt::print("| {} | {} | {:.2f}M | {} | {:.2f}M | {:.1f} GB | {:.1f} GB | {} | {:.2f} TB |{}\n", preset,
                 offload.name().empty() ? "-" : offload.name(), r.device_T / 1e6, host_T, r.T / 1e6,
                 r.peak.total_bytes() / 1e9, whole_sequence_bytes(r.peak) / 1e9, r.peak.moment,
                 nodes_of(r.peak) / 1e12, disk ? on_disk : "");
      std::vector<std::string> values = {
          objective->spec(), "adamw", std::to_string(world), std::to_string(sp), scheme, "3",
          std::to_string(a.budget_bytes), std::to_string(a.gpu_floor_bytes), offload.name(),
          std::to_string(r.T), std::to_string(r.device_T), r.host_T > 0 ? std::to_string(r.host_T) : "",
          std::to_string(r.peak.total_bytes()), std::to_string(whole_sequence_bytes(r.peak)),
          std::to_string(r.peak.host_bytes()), fmt::format("{:.0f}", nodes_of(r.peak)), r.peak.moment};
      if (disk) {
        const bool some = r.placed.host_layers < L;
        for (const auto& v : {fmt::format("{:.0f}", a.disk_bytes_per_node), fmt::format("{:.0f}", a.disk_read_bandwidth),
                              fmt::format("{:.0f}", a.device_flops),
                              std::to_string(disk_tier ? r.placed.host_layers : L),
                              std::to_string(std::int64_t(r.placed.disk_node) / kDevicesPerNode),
                              fmt::format("{:.0f}", r.placed.disk_node),
                              some ? fmt::format("{:.6g}", r.stall.read_seconds) : "",
                              some ? fmt::format("{:.6g}", r.stall.compute_seconds) : "",
                              some ? fmt::format("{:.6g}", r.stall.factor) : "", r.tier_bound})
          values.push_back(v);
      }
      table.add({preset, spec, "bf16", "projection", 0, values});
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
  const bool disk_bound = host_bound && best.tier_bound == "disk";
  const auto L = best_workload.config.num_hidden_layers;
  // The same placement of the checkpoints at 90% of T* as at T*: the terms' slopes, not a layer moved between tiers.
  auto at_T = best_workload;
  set_checkpoint_host_layers(at_T, best.placed.host_layers < L ? best.placed.host_layers : -1);
  auto shorter = at_T;
  shorter.seq_len = std::max<std::int64_t>(2 * sp, best.T / 10 * 9 / (2 * sp) * (2 * sp));
  const auto before = training_memory(*method, shorter);
  const auto stops = disk_bound ? bytes_per_position(memory::offload_disk_terms(at_T), best.T,
                                                     memory::offload_disk_terms(shorter), shorter.seq_len)
                     : host_bound ? bytes_per_position(best.peak.host, best.T, before.host, shorter.seq_len)
                                  : bytes_per_position(best.peak.terms, best.T, before.terms, shorter.seq_len);
  double per_position = 0;
  for (const auto& [name, bytes] : stops) per_position += bytes;
  if (best.T > kProjectionCeiling - 2 * sp)
    fmt::print("What stops a longer T: nothing the models hold below {:.2f}M positions, where the search stops; per "
               "rank the device's peak grows by {:.1f} KB per position of the whole sequence there:\n",
               best.T / 1e6, per_position / 1e3);
  else if (disk_bound)
    fmt::print("What stops a longer T: the disk. The host keeps H[0..{}) within {:.1f} TB per node and the disk holds "
               "H[{}..{}], {:.2f} TB of {:.1f} TB per node at T*; per rank it grows by {:.1f} KB per position of the "
               "whole sequence:\n", best.placed.host_layers, a.host_bytes_per_node / 1e12, best.placed.host_layers,
               L - 1, best.placed.disk_node / 1e12, a.disk_bytes_per_node / 1e12, per_position / 1e3);
  else if (host_bound && disk)
    fmt::print("What stops a longer T: the host. With every checkpoint on disk the rest of the offload tier alone "
               "outgrows {:.1f} TB per node; per rank it grows by {:.1f} KB per position of the whole sequence:\n",
               a.host_bytes_per_node / 1e12, per_position / 1e3);
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
  if (disk) {
    // Where each tier alone would stop the best row, whatever the device: the host holding every checkpoint (no disk
    // tier), and the host beside the disk.
    const auto tier_T = [&](bool with_disk) {
      return max_projected_seq_of(best_workload, 2 * sp,
                                  [&](const Workload& at) { return place_checkpoints(*method, at, a, with_disk).fits; });
    };
    const auto host_only = tier_T(false), with_disk = tier_T(true);
    auto beyond = best_workload;
    beyond.seq_len = with_disk + 2 * sp;
    const auto why = place_checkpoints(*method, beyond, a, true).bound;
    fmt::print("The tiers' own bounds for this row, whatever the device holds: the host alone (every offloaded "
               "checkpoint on it) {:.2f}M; the host with {:.1f} TB of disk per node {}{:.2f}M ({}).\n",
               host_only / 1e6, a.disk_bytes_per_node / 1e12, with_disk > kProjectionCeiling - 2 * sp ? ">= " : "",
               with_disk / 1e6,
               with_disk > kProjectionCeiling - 2 * sp ? "the search's ceiling"
               : why == "disk" ? "then the disk is full"
                               : "then what is not checkpoints outgrows the host");
    if (best.placed.host_layers >= L)
      fmt::print("The disk tier at T*: empty (the host holds every offloaded checkpoint); no stall.\n\n");
    else
      fmt::print("The disk tier at T*: H[{}..{}] on disk, {:.2f} TB per node. A layer's checkpoints for the node's {} "
                 "ranks ({:.1f} GB) read back in {:.3f} s at {:.1f} GB/s, against {:.3f} s of that layer's backward on "
                 "a device of {:.0f} TFLOP/s: stall factor {:.3f} ({}); the layers' backward takes {:.3f}x its compute "
                 "time.\n\n",
                 best.placed.host_layers, L - 1, best.placed.disk_node / 1e12, kDevicesPerNode,
                 best.placed.disk_node / double(L - best.placed.host_layers) / 1e9, best.stall.read_seconds,
                 a.disk_read_bandwidth / 1e9, best.stall.compute_seconds, a.device_flops / 1e12, best.stall.factor,
                 best.stall.factor > 1 ? "> 1: the disk stalls the device" : "<= 1: the read hides behind the compute",
                 best.stall.backward_factor);
  }
  const auto csv = table.write(a.output.out_dir,
                               fmt::format("project-sp{}-nproc{}-{}{}", sp, world, scheme, disk ? "-disk" : ""),
                               collect_provenance(command_line));
  fmt::print("results: {}\n", std::filesystem::absolute(csv).string());
  return 0;
}

}  // namespace sbp
