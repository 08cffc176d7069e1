// What a data-parallel command (train, maxlen, sweep) shares: the flags, this process's place among the ranks (one
// process, a rank of the --nproc launcher, or a rank under torchrun), its device and communicator, and measurements
// that the ranks agree on.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include <c10/core/Device.h>

#include "core/training/communicator.h"
#include "core/training/sequence_scheme.h"
#include "experiments/launch.h"
#include "experiments/measure.h"
#include "experiments/setup.h"

namespace CLI {
class App;
}

namespace sbp {

class Trainer;
struct TrainOptions;
struct Workload;

struct RankFlags {
  int nproc = 1;           // ranks on this machine (--nproc); under torchrun, the environment's
  int zero = 0;            // ZeRO stage (--zero): 0 = DDP, 1 = + optimizer states sharded, 2 = + gradients, 3 = + parameters
  int dist_timeout = 300;  // seconds a collective or the rendezvous may take before the rank gives up
  int sp = 1;              // ranks each sequence is split over (--sp; train only)
  SequenceScheme sp_scheme = SequenceScheme::allgather;  // how a group exchanges K/V (--sp-scheme)
  // The ranks these flags ask for, as the memory models' features (Ranks::add_to), on `device`: what one process
  // predicts for them (maxlen --model-only for --nproc N).
  void add_to(Workload& w, c10::Device device) const;
};
// --nproc, --zero and --dist-timeout; `what` says what each rank does (for --nproc's help).
void add_rank_options(CLI::App& app, RankFlags& flags, const std::string& what);
// --sp and --sp-scheme, for a command whose steps run on sequence shards (train, maxlen).
void add_sequence_parallel_option(CLI::App& app, RankFlags& flags);
// Why `world` ranks cannot run with --sp `sp` (empty when they can): a command checks it before launching its ranks.
std::string sequence_layout_problem(int world, int sp);
// Why a group cannot exchange K/V by `scheme` on `device` in `dtype` (empty when it can): the ring's attention runs
// key blocks, which CUDA's 16-bit path does not have. Checked before any group forms.
std::string sequence_scheme_problem(SequenceScheme scheme, c10::DeviceType device, c10::ScalarType dtype);

// The refusal of a global batch of `rows` rows (from `source`: "--batch 3", a batch file) that does not split evenly
// over `world` ranks, with the sizes that would: every command's --batch is the global batch, each rank takes
// rows / world of it.
std::string uneven_batch(int world, const std::string& source, std::int64_t rows);

struct Ranks {
  int rank = 0, world = 1;
  int zero = 0;  // the stage when world > 1, else 0
  c10::Device device = c10::Device(c10::kCPU);
  std::unique_ptr<Communicator> comm;  // none for one process
  // Sequence parallelism: groups of sp consecutive ranks split each sequence of the rows they share; `sequence` is
  // this rank's group (none when sp == 1). The gradients are summed over every rank (comm).
  int sp = 1;
  SequenceScheme sp_scheme = SequenceScheme::allgather;
  std::unique_ptr<Communicator> sequence;
  int data_rank() const { return rank / sp; }    // which rows of the global batch: a group's ranks share them
  int data_world() const { return world / sp; }  // the global batch splits into this many parts
  bool writer() const { return rank == 0; }  // rank 0 writes every output and prints the progress
  std::string describe() const;              // ", 2 ranks (ZeRO-2, Gloo)" or ""
  // These ranks as the memory models' per-rank features: data parallelism (world 1: one process, stage 0; Gloo, on
  // the CPU, copies its collectives' buffers, NCCL does not) and sequence parallelism (sp 1: whole sequences). What
  // Trainer::add_optimizer_memory sets from its features, for a driver that predicts before (or without) a Trainer.
  void add_to(Workload& w) const;
  // This rank's sequence group, for the Trainer's sequence-parallel feature (none when sp == 1).
  void add_to(TrainOptions& options) const;
};
// This process's rank (from `env`, see rank_from_environment) with the setup's device and threads applied: one
// intra-op thread per rank unless --threads; on CUDA the local rank's GPU (NCCL), else Gloo; connected to the others
// (a FileStore from the launcher or torchrun's TCPStore). One process when `env` is empty.
Ranks join_ranks(const RankFlags& flags, const std::optional<RankEnv>& env, const Setup& setup);

// Training steps of `trainer` on this rank's rows, measured as measure_training does, but with no budget inside the
// step (a rank stopped at its budget would leave the others waiting in a collective): every rank runs the step to
// its end, and the result is the ranks' worst: the largest peak (status "oom" when it exceeds budget_bytes > 0, as
// a GPU of that size would have failed) and, repeat by repeat, the slowest rank's seconds. One process: exactly
// measure_training. A stage-3 trainer's parameters stay sharded; see DataParallel::unshard.
Measurement measure_training_on_ranks(Trainer& trainer, const Ranks& ranks, const Batch& batch, int warmup, int repeats,
                                      std::int64_t budget_bytes);

}  // namespace sbp
