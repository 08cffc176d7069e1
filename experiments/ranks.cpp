#include "experiments/ranks.h"

#include <algorithm>
#include <chrono>
#include <map>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>

#include "core/training/c10d_communicator.h"
#include "experiments/cli_checks.h"
#include "core/training/trainer.h"
#include "profiler/cuda_memory.h"
#include "core/io/input_error.h"
#include "core/model/chunk_attention_kernels.h"

namespace sbp {

std::string uneven_batch(int world, const std::string& source, std::int64_t rows) {
  const auto below = rows / world * world, above = below + world;
  return fmt::format("--nproc {}: the global batch ({}) has {} {}, which do not split evenly over {} ranks (each "
                     "rank takes rows / {}); {} rows would{}", world, source, rows, rows == 1 ? "row" : "rows", world, world,
                     below > 0 ? fmt::format("{} or {}", below, above) : std::to_string(above),
                     below > 0 ? "" : " (at least one row per rank)");
}

void add_rank_options(CLI::App& app, RankFlags& flags, const std::string& what) {
  app.add_option("--nproc", flags.nproc, "data-parallel ranks on this machine (Gloo on the CPU, NCCL with --device "
                 "cuda, one GPU per rank: cuda:(local rank mod GPU count), an index given in --device then ignored): "
                 "N fresh processes of this command, " + what + "; gradients summed over ranks once per group at "
                 "its gradient-ready event, the loss normalised by the global batch's totals; rank 0 writes every "
                 "output; one intra-op thread per rank unless --threads. Under torchrun (RANK, WORLD_SIZE, "
                 "LOCAL_RANK, MASTER_ADDR, MASTER_PORT set) each process is one rank")
      ->check(sbp::within(1, 1024));
  app.add_option("--zero", flags.zero, "ZeRO stage of a data-parallel run: 0 = DDP (every rank all-reduces each "
                 "group's gradients and updates everything), 1 = + optimizer states sharded (each rank updates its "
                 "slice of every tensor, then the slices are all-gathered), 2 = + gradients reduce-scattered into the "
                 "slices at each group's gradient-ready event (full gradients freed), 3 = + parameters sharded (a "
                 "layer gathered for its forward and again for its backward chunk loop, freed after each; the "
                 "embedding and head gathered for the whole step)")->check(sbp::within(0, 3));
  app.add_option("--dist-timeout", flags.dist_timeout, "seconds a rank waits for the others (rendezvous and every "
                 "collective) before it fails")->check(CLI::PositiveNumber);
}

void add_sequence_parallel_option(CLI::App& app, RankFlags& flags) {
  app.add_option("--sp", flags.sp, "sequence parallelism: each sequence split over N ranks (groups of N consecutive "
                 "ranks; --nproc / N data-parallel groups, each its rows of the global batch): a zig-zag split of the "
                 "positions, every layer's K/V all-gathered over the group and their gradients reduce-scattered; the "
                 "gradients summed over all ranks as --nproc alone does. Standard BP, checkpointing and StreamBP run "
                 "on a shard; --nproc must be a multiple of N")
      ->check(sbp::within(1, 1024));
  app.add_option("--sp-scheme", flags.sp_scheme, "how a sequence-parallel group exchanges K/V: allgather (every rank "
                 "holds a layer's whole K/V and their gradient sums; the default) or ring (each rank keeps its own K/V, "
                 "the blocks go round the ring with their dK/dV and home again: no rank holds the whole sequence's)")
      ->transform(CLI::CheckedTransformer(std::map<std::string, SequenceScheme>{{"allgather", SequenceScheme::allgather},
                                                                                {"ring", SequenceScheme::ring}}));
}

std::string sequence_layout_problem(int world, int sp) {
  if (sp <= 1) return "";
  if (world == 1)
    return fmt::format("--sp {} splits each sequence over {} ranks, and this is one process: add --nproc {} (or a "
                       "multiple of it), or run under torchrun", sp, sp, sp);
  if (world % sp != 0)
    return fmt::format("--sp {}: {} ranks do not form groups of {} (--nproc, or torchrun's WORLD_SIZE, must be a "
                       "multiple of --sp, e.g. {})", sp, world, sp, (world / sp + 1) * sp);
  return "";
}

std::string sequence_scheme_problem(SequenceScheme scheme, c10::DeviceType device, c10::ScalarType dtype) {
  if (scheme != SequenceScheme::ring) return "";
  const auto choice = choose_chunk_attention(device, dtype);
  if (choice.blocks) return "";
  return fmt::format("--sp-scheme ring runs attention as key blocks, and {} in {} has none ({} takes whole chunks; "
                     "issue #48): --sp-scheme allgather, or another --dtype", c10::DeviceTypeName(device, true),
                     c10::toString(dtype), choice.name());
}

std::string Ranks::describe() const {
  if (world == 1) return "";
  return fmt::format(", {} ranks ({}, {}){}", world, zero == 0 ? "DDP" : fmt::format("ZeRO-{}", zero),
                     device.is_cuda() ? "NCCL" : "Gloo",
                     sp > 1 ? fmt::format(", each sequence over {} ({} data-parallel)", sp, data_world()) : "");
}

Ranks join_ranks(const RankFlags& flags, const std::optional<RankEnv>& env, const Setup& setup) {
  Ranks ranks;
  ranks.world = env ? env->world_size : 1;
  ranks.rank = env ? env->rank : 0;
  if (ranks.world == 1 && flags.zero != 0)
    throw InputError(fmt::format("--zero {} shards across data-parallel ranks, and this is one process: add "
                                            "--nproc N (N >= 2) or run under torchrun, or drop --zero", flags.zero));
  ranks.zero = ranks.world > 1 ? flags.zero : 0;
  if (const auto problem = sequence_layout_problem(ranks.world, flags.sp); !problem.empty())
    throw InputError(problem);
  if (flags.sp_scheme != SequenceScheme::allgather && flags.sp <= 1)
    throw InputError(fmt::format("--sp-scheme {} exchanges K/V within a sequence-parallel group: add --sp N (N >= 2)",
                                 sequence_scheme_name(flags.sp_scheme)));
  if (const auto problem = sequence_scheme_problem(flags.sp_scheme, setup.device.type(), setup.model_dtype());
      !problem.empty())
    throw InputError(problem);
  // The ranks share this machine's cores: one intra-op thread each unless --threads says otherwise.
  if (ranks.world > 1 && setup.threads == 0) at::set_num_threads(1);
  setup.apply_threads();
  ranks.device = setup.device;
  if (ranks.world == 1) return ranks;
  // A data-parallel CUDA run has one GPU per rank, by its local rank (as torchrun's LOCAL_RANK); --device cuda:N
  // names the GPU of a single process only.
  if (ranks.device.is_cuda()) {
    // The launcher's ranks (STREAMBP_STORE) all run here; NCCL refuses two ranks on one GPU.
    if (!env->file_store.empty() && ranks.world > cuda_device_count())
      throw InputError(fmt::format("--nproc {} --device cuda: NCCL takes one GPU per rank and this machine "
                                              "has {}", ranks.world, cuda_device_count()));
    ranks.device = c10::Device(c10::kCUDA, c10::DeviceIndex(env->local_rank % cuda_device_count()));
    // The rank's GPU is this process's current device before any CUDA work (no context on another GPU).
    c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(ranks.device);
  }
  const RendezvousOptions rendezvous{.rank = ranks.rank, .world_size = ranks.world, .file_store = env->file_store,
                                     .master_addr = env->master_addr, .master_port = env->master_port,
                                     .timeout = std::chrono::seconds(flags.dist_timeout)};
  ranks.comm = ranks.device.is_cuda() ? make_nccl_communicator(rendezvous, ranks.device.index())
                                      : make_gloo_communicator(rendezvous);
  // Every rank forms the same groups: a rank given another --sp (torchrun's ranks each have their own command line)
  // would wait for a group the others never form. Compared before any is formed.
  if (const auto d = first_disagreement(*ranks.comm, {flags.sp, std::int64_t(flags.sp_scheme)}))
    throw InputError(d->index == 0 ? fmt::format("rank {} and rank 0 disagree on --sp ({} and {})", d->rank, d->theirs,
                                                 d->rank0)
                                   : fmt::format("rank {} and rank 0 disagree on --sp-scheme ({} and {})", d->rank,
                                                 sequence_scheme_name(SequenceScheme(d->theirs)),
                                                 sequence_scheme_name(SequenceScheme(d->rank0))));
  if (flags.sp > 1) {
    ranks.sp = flags.sp;
    ranks.sp_scheme = flags.sp_scheme;
    std::vector<int> members;
    for (int i = 0; i < flags.sp; ++i) members.push_back(ranks.data_rank() * flags.sp + i);
    ranks.sequence = ranks.comm->subgroup("sp" + std::to_string(ranks.data_rank()), members);
  }
  return ranks;
}

namespace {
void add_rank_features(Workload& w, int world, int zero, int sp, SequenceScheme scheme, c10::Device device) {
  w.add(DataParallelism{.world_size = world, .zero_stage = world > 1 ? zero : 0,
                        .collective_copies = world > 1 && !device.is_cuda()});
  w.add(SequenceParallelism{std::max(sp, 1), scheme});
}
}  // namespace

void RankFlags::add_to(Workload& w, c10::Device device) const {
  add_rank_features(w, nproc, zero, sp, sp_scheme, device);
}

void Ranks::add_to(Workload& w) const { add_rank_features(w, world, zero, sp, sp_scheme, device); }

void Ranks::add_to(TrainOptions& options) const {
  options.sequence_group = sequence.get();
  options.sequence_scheme = sp_scheme;
}

Measurement measure_training_on_ranks(Trainer& trainer, const Ranks& ranks, const Batch& batch, int warmup, int repeats,
                                      std::int64_t budget_bytes) {
  if (!ranks.comm) return measure_training(trainer, batch, warmup, repeats, budget_bytes);
  auto m = measure_training(trainer, batch, warmup, repeats, 0);
  // [peak, seconds of each repeat] of every rank: the worst of each.
  std::vector<double> mine = {double(m.peak_bytes)};
  mine.insert(mine.end(), m.bp_seconds.begin(), m.bp_seconds.end());
  const auto all = ranks.comm->all_gather(at::tensor(mine, at::TensorOptions(at::kDouble).device(ranks.comm->device())))
                       .amax(0).cpu();
  m.peak_bytes = std::int64_t(all[0].item<double>());
  for (std::size_t i = 0; i < m.bp_seconds.size(); ++i) m.bp_seconds[i] = all[std::int64_t(i) + 1].item<double>();
  if (budget_bytes > 0 && m.peak_bytes > budget_bytes) {
    m.status = StepStatus::oom;
    m.error = fmt::format("a rank's peak {} exceeds the budget of {}", format_bytes(m.peak_bytes), format_bytes(budget_bytes));
  }
  return m;
}

}  // namespace sbp
