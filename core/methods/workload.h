// What a step is asked to do, as the analytic models see it (Workload), and what they answer (MemoryEstimate): the
// memory models of the methods (memory_terms.h), of the training step (core/training/training_memory.h) and the FLOP
// models read a Workload; drivers fill it from a model, an objective and a batch (experiments/batches.h,
// make_workload) or by hand for a projection.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include <c10/core/ScalarType.h>

#include "core/methods/kernel_workspace.h"
#include "core/model/config.h"
#include "core/model/sequence_shard.h"
#include "core/offload/offload_kind.h"

namespace sbp {

// Analytic peak memory: named terms in bytes, printed next to the measured peak.
struct MemoryTerm {
  std::string name;
  std::int64_t bytes = 0;
  // Sized by the whole sequence even on a rank of a sequence-parallel group (the gathered K/V, their gradients, the
  // exchange's buffers), where the other per-position terms are sized by the rank's shard.
  bool whole_sequence = false;
};
struct MemoryEstimate {
  std::string moment;  // when the device's peak happens, e.g. "head backward"
  std::vector<MemoryTerm> terms;  // on the device at that moment
  // In the offload tier at its own peak (empty without offload): host memory on CUDA, memory-mapped files on the CPU.
  std::vector<MemoryTerm> host;
  std::int64_t total_bytes() const;  // the device's
  std::int64_t host_bytes() const;
};

namespace memory {
struct Sizes;
struct TierTimeline;
struct StepMoments;
}  // namespace memory
struct Workload;

// The features of a step (its distribution, what is offloaded), each a kind of its own that adds its own terms to the
// memory models through the hooks it has among four (memory_terms.h runs them, in the workload's order):
//   size(Sizes&): the sizes every model's terms are written in (this rank's positions, slices, what stays on the device);
//   add_moments(w, streamed, moments): moments of its own beside the method's;
//   add_tier_terms(sizes, timeline): what it keeps in the offload tier;
//   add_step_moments(w, sizes, step): a training step's, around the optimizer's update (core/training/training_memory.h).
// A new kind is a struct here, in WorkloadFeature, and its hooks in a file of its own.

// One kind of state in the offload tier (core/offload/offload_kind.h); offload_memory.cpp.
struct Offload {
  OffloadKind kind;
  // Checkpoints only: the third tier (node-local disk, issue #61). The host keeps layers [0, host_layers) of the
  // offloaded checkpoints and the disk the rest (offload_disk_terms); -1: every one on the host. On the CPU the file
  // tier is the disk (its files' blocks, file_tier.cpp): its model is host_layers = 0.
  std::int64_t host_layers = -1;
  // Or a host budget in bytes (a run's --offload-host-bytes): the layers whose checkpoints fit in it, whole, in the
  // order the forward stores them (core/offload/split_tier.h); -1: none, host_layers says.
  std::int64_t host_bytes = -1;
  // k of z.L: host_layers, or host_bytes over one checkpoint's bytes, or z.L when neither is set.
  std::int64_t checkpoint_host_layers(const memory::Sizes& z) const;
  void size(memory::Sizes&) const;
  void add_moments(const Workload&, bool streamed, std::vector<MemoryEstimate>&) const;
  void add_tier_terms(const memory::Sizes&, memory::TierTimeline&) const;
  void add_step_moments(const Workload&, const memory::Sizes&, memory::StepMoments&) const;
};
// Data parallelism (ARCHITECTURE.md §12), modelled per rank (rank 0, whose slices are the longest): world_size ranks at
// ZeRO stage zero_stage (0 = DDP, 1 = + optimizer states sharded, 2 = + gradients reduce-scattered, 3 = + parameters
// sharded, gathered while in use). Trainer::add_optimizer_memory adds it from its DataParallel (and the optimizer
// bytes from the slices it updates); a projection adds it by hand before add_projected_optimizer. collective_copies:
// whether the backend's reduce-scatter and all-gather hold one more [N, length] copy of their buffer while they run
// (Communicator::copies_collective_buffers: Gloo yes, NCCL no). data_parallel_memory.cpp.
struct DataParallelism {
  int world_size = 1, zero_stage = 0;
  bool collective_copies = false;
  void size(memory::Sizes&) const;
  void add_moments(const Workload&, bool streamed, std::vector<MemoryEstimate>&) const;
  void add_step_moments(const Workload&, const memory::Sizes&, memory::StepMoments&) const;
};
// Sequence parallelism (ARCHITECTURE.md §16): each sequence of seq_len positions split over this many ranks (a group
// within the data-parallel ranks), modelled for the rank with the most positions (longest_zigzag_shard) and the
// latest query (rank 0's last block ends at seq_len). sequence_parallel_memory.cpp.
// scheme: how the K/V travel (the all-gather's whole-sequence terms, or the ring's blocks).
struct SequenceParallelism {
  int ranks = 1;
  SequenceScheme scheme = SequenceScheme::allgather;
  void size(memory::Sizes&) const;
};
using WorkloadFeature = std::variant<Offload, DataParallelism, SequenceParallelism>;

// Packed rows (ARCHITECTURE.md §3 "Packed rows"): each row's sequence lengths, in order, summing to the row's length.
// What they change in the models is attention's: its work is the sum of the sequences' causal triangles, and every
// attention call is one sequence of one row (packed_memory.cpp).
struct PackedLengths {
  std::vector<std::vector<std::int64_t>> rows;
  std::int64_t longest() const;
  double causal_pairs() const;  // sum over every sequence of L (L + 1) / 2: query-key pairs per head
};

struct Workload {
  ModelConfig config;
  c10::ScalarType dtype = c10::kFloat;  // compute dtype (Model::dtype)
  std::int64_t batch_size = 1, seq_len = 1;
  // What the objective adds (PreparedObjective::buffer_bytes_per_token and needs_statistics): its per-position
  // buffers (targets, masks, GRPO's old/ref log-probs), and whether a streamed head runs the statistics pass.
  std::int64_t objective_bytes_per_token = 16;
  bool statistics_pass = false;
  // The rows' sequences when they are packed (none: each row one sequence of seq_len). Shared, so that a search over T
  // copies it for free; whoever changes seq_len gives the lengths at that T.
  std::shared_ptr<const PackedLengths> packed;
  // LoRA (lora_rank > 0): adapters on the named targets of every layer, lora_parameters elements in all; the base
  // is frozen, so only the adapters have gradients.
  std::int64_t lora_rank = 0, lora_parameters = 0;
  int lora_attention_targets = 0, lora_mlp_targets = 0;  // adapted projections per layer among q,k,v,o / gate,up,down
  std::vector<std::string> lora_targets;                  // their names (the memory model needs o and down by name)
  bool adapts(const std::string& target) const {
    for (const auto& t : lora_targets)
      if (t == target) return true;
    return false;
  }
  // Intra-op threads: CPU kernels keep scratch per thread.
  std::int64_t threads = 1;
  // Whether a linear's graph saves a view of its weight: at::linear's does, so a weight fetched or gathered for the
  // forward (ZeRO-3, parameter offload) stays alive until the layer's backward in a method that keeps the whole
  // graph; the widened narrow-dtype linear on the CPU (core/model/gemm.h) saves the parameter itself, which the drop
  // after its use empties. Set from the running machine's GEMM paths (make_workload); true for a GPU.
  bool graph_keeps_weight_views = true;
  // Whether the CPU's chunk attention runs its bf16 kernel on bf16 operands (core/model/chunk_attention_kernels.h)
  // rather than fp32 blocks of upcast copies: their copies and scratch differ. Set from the running machine
  // (make_workload).
  bool narrow_attention_blocks = false;
  // What the kernel running at a moment allocates beyond its inputs and outputs: the running machine's calibration,
  // or none (projections). The models ask it through workspace_bytes, which refuses to guess when nothing is attached.
  std::shared_ptr<const KernelWorkspaces> workspaces;
  std::int64_t workspace_bytes(const KernelCall& call) const;
  // A training step (Trainer): the optimizer's states, held through the whole step, and the most its update allocates
  // at once beyond them (optimizer_memory in core/training/optimizer.h); both 0 for a forward + backward alone.
  std::int64_t optimizer_state_bytes = 0, optimizer_update_bytes = 0;
  // Micro-batches after the first of a step (gradient accumulation) run with every gradient already there.
  bool accumulating = false;
  // Trainable tensors and their gradients (Model::grad_dtype); Undefined: the compute dtype.
  c10::ScalarType grad_dtype = c10::ScalarType::Undefined;
  c10::ScalarType gradient_dtype() const { return grad_dtype == c10::ScalarType::Undefined ? dtype : grad_dtype; }
  // The step's features beside its shapes and dtypes: how it is distributed and what is offloaded (none: one process,
  // everything on the device). Each kind at most once (add replaces one of the same kind), kept in the order of
  // WorkloadFeature's kinds (offload kinds in OffloadKind's), so that the estimate's terms do not depend on the order
  // the features were added in.
  std::vector<WorkloadFeature> features;
  void add(WorkloadFeature feature);
  void remove_sequence_parallelism();
  bool offloads(OffloadKind kind) const;
  // Data parallelism's world size and ZeRO stage (1 and 0 without it).
  int world_size() const;
  int zero_stage() const;
  bool data_parallel() const { return world_size() > 1; }
  // Sequence parallelism's ranks per sequence (1: whole sequences).
  int sequence_parallel() const;
  SequenceScheme sequence_scheme() const;  // allgather without sequence parallelism
  // Whether a streamed head of `head_chunk` tokens runs the statistics pass (streamed_head): the objective needs it
  // and one chunk does not hold the sequence, which a sequence-parallel rank's never does.
  bool runs_statistics_pass(std::int64_t head_chunk) const {
    return statistics_pass && (head_chunk < seq_len || sequence_parallel() > 1);
  }
};

}  // namespace sbp
