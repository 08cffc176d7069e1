// The terms the methods' memory models are written in (ARCHITECTURE.md §7), for the files that write a model: each
// method's next to its code (core/methods/streambp_memory.cpp, baselines/*_memory.cpp), the training step's in
// core/training/training_memory.cpp. What each term counts, and where it was measured, is written beside its
// definition (memory_model.cpp, data_parallel_memory.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include <c10/core/ScalarType.h>

#include "core/io/dtype.h"
#include "core/methods/memory_model.h"
#include "core/model/sequence_shard.h"
#include "core/io/input_error.h"

namespace sbp::memory {

// Calls `hook` with each feature of `w`, in the workload's order; the hook asks (`if constexpr (requires ...)`) whether
// the feature's kind has the function it calls (workload.h lists the four).
template <class Hook>
void for_each_feature(const Workload& w, Hook&& hook) {
  for (const auto& feature : w.features) std::visit(hook, feature);
}

// The sizes every model reads: bytes per element, the workload's dimensions, the weights and gradients alive at
// each stage of a step, and data parallelism's share of them (this rank's: rank 0, whose slices are the longest).
struct Sizes {
  std::int64_t s, f, g;             // bytes per element: model (compute) dtype, its statistics dtype, gradients
  std::int64_t B, T, d, V, L, P;  // T: the positions this rank holds (its shard's under sequence parallelism)
  std::int64_t Tg;                // the whole sequence's (the objective's buffers, the gathered K/V)
  std::int64_t sp;                // ranks of the sequence-parallel group (1: none)
  bool lora;
  std::int64_t weights;          // base + adapters (the trainable ones in the gradient dtype: fp32 masters)
  std::int64_t lm_grad;          // the lm_head/embedding gradient [V, d] (none under LoRA: frozen)
  std::int64_t all_gradients;    // every trainable tensor's gradient
  std::int64_t layer_gradients;  // every gradient that exists while the layers are back-propagated (at layer 0)
  std::int64_t head_gradients;   // what the head leaves: lm_head (tied: the embedding's) and final norm gradients
  std::int64_t layer_grad;       // one decoder layer's gradients (its adapters' under LoRA)
  // Mixed precision (g > s): a trainable master is cast to the compute dtype where it is used, and a graph keeps
  // that copy (linear saves its weight): cast bytes per trainable element, 0 when the masters are the weights.
  std::int64_t cast;
  // Set by the features (Offload's size): the layer checkpoints, the gradients after their events, the trainable
  // tensors between their uses in the offload tier; the optimizer's states on the device (none in the tier).
  bool offload_checkpoints = false, offload_gradients = false, parameters_in_tier = false;
  std::int64_t device_optimizer_states;
  explicit Sizes(const Workload& w)
      : s(std::int64_t(c10::elementSize(w.dtype))),
        f(std::int64_t(c10::elementSize(compute_dtype(w.dtype)))),
        g(std::int64_t(c10::elementSize(w.gradient_dtype()))),
        B(w.batch_size), T(w.seq_len),
        d(w.config.hidden_size), V(w.config.vocab_size), L(w.config.num_hidden_layers), P(w.config.num_parameters()),
        Tg(w.seq_len), sp(1), lora(w.lora_rank > 0),
        weights(lora ? P * s + w.lora_parameters * g : P * g), lm_grad(lora ? 0 : V * d * g),
        all_gradients(lora ? w.lora_parameters * g : P * g),
        // Full fine-tuning: all but an untied embedding's, which only the embedding backward writes.
        layer_gradients(lora ? w.lora_parameters * g : P * g - (w.config.tie_word_embeddings ? 0 : V * d * g)),
        head_gradients(lora ? 0 : (V + 1) * d * g),
        layer_grad(lora ? w.lora_parameters * g / std::max<std::int64_t>(1, L)
                        : (P - (w.config.tie_word_embeddings ? 1 : 2) * V * d - d) * g / std::max<std::int64_t>(1, L)),
        cast(g > s ? s : 0), device_optimizer_states(w.optimizer_state_bytes), tied(w.config.tie_word_embeddings),
        head_group(lora ? 0 : tied ? d * g : (V + 1) * d * g), embedding_group(lm_grad),
        largest_tensor(lora ? std::min(w.lora_parameters, w.lora_rank * std::max({w.config.intermediate_size, d,
                                                                                  w.config.q_width()}))
                            : V * d) {
    for_each_feature(w, [&](const auto& f) {
      if constexpr (requires { f.size(*this); }) f.size(*this);
    });
    // ZeRO-3: the trainable tensors are this rank's slices, the embedding and head gathered for the whole step (the
    // BP's "weights"), a layer's only while it is in use (gathered_layer), none but the slices between steps.
    rest_weights = weights;
    // One process's parameter offload (ParameterHome) is ZeRO-3 with nothing kept on the device: the trainable tensors
    // in the tier between uses, fetched where ZeRO-3 gathers.
    offloaded_parameters = parameters_in_tier && N == 1;
    if (parameters_leave()) {
      // trainable bytes = gradient bytes; the slices in the tier with parameter offload
      rest_weights = weights - all_gradients + (parameters_in_tier ? 0 : slice_elements(all_gradients) * g);
      weights = rest_weights + embedding_group + head_group;
    }
  }
  // Bytes on the device of `alive` layer checkpoints ([B, T, d] each): all of them, or with offload the one in use
  // and the one fetched ahead of it (layer_checkpoints.h).
  std::int64_t checkpoints(std::int64_t alive) const {
    return (offload_checkpoints ? std::min<std::int64_t>(alive, 2) : alive) * B * T * d * s;
  }
  // Compute-dtype copies of the trainable tensors a graph keeps (0 unless mixed precision).
  std::int64_t layer_copies() const { return layer_grad / g * cast; }
  std::int64_t lm_head_copy() const { return lm_grad / g * cast; }
  std::int64_t all_copies() const { return layer_gradients / g * cast; }  // every layer's and the lm_head's

  // Data parallelism (ARCHITECTURE.md §12), this rank's share. The gradient groups, in event order: the head (final norm; an
  // untied lm_head), every layer from the last, the embedding (tied: the lm_head's gradient too, which exists from the
  // head backward on). Under LoRA only the layers' adapters are trainable: the head and embedding have no event.
  std::int64_t N = 1;  // data parallelism's ranks and ZeRO stage, whether its backend copies buffers (DataParallelism)
  int stage = 0;
  bool collective_copies = false;
  bool tied;
  std::int64_t head_group, embedding_group;  // gradient bytes of the head's and the embedding's groups
  std::int64_t largest_tensor;               // elements of the largest trainable tensor (the [V, d] embedding)
  bool sharded_gradients() const { return N > 1 && stage >= 2; }
  bool sharded_parameters() const { return N > 1 && stage >= 3; }
  bool offloaded_parameters = false;  // one process's, in the tier (Workload::offload_parameters)
  // Whether the trainable tensors are on the device only while in use (ZeRO-3's gathers, one process's fetches).
  bool parameters_leave() const { return sharded_parameters() || offloaded_parameters; }
  // The weights held between steps (ZeRO-3: the frozen base and the trainable slices; else `weights`).
  std::int64_t rest_weights = 0;
  // ZeRO-3: a decoder layer's trainable tensors gathered in full while it is in use (its forward; its backward, the
  // whole chunk loop for StreamBP), beside its slices: "one layer of extra memory".
  std::int64_t gathered_layer() const { return parameters_leave() ? layer_grad : 0; }
  // ZeRO-3's gather of a group of `bytes` (DataParallel::use): this rank's [slice] packed and the [N, slice] gathered
  // (with the backend's copy while it runs), then the full tensors made from it while it is alive.
  std::int64_t gather_buffers(std::int64_t bytes, bool copies) const {
    if (offloaded_parameters) return bytes;  // one process: the fetched tensors themselves
    const auto slice = slice_elements(bytes) * g;
    return std::max((N + 1 + (copies ? N : 0)) * slice, N * slice + bytes);
  }
  // Elements of this rank's slices of a group of `bytes` gradient bytes: ceil(numel / N) of every tensor (rank 0's,
  // the longest). Counted on the group as a whole: each tensor's padding (< N elements) is left out.
  std::int64_t slice_elements(std::int64_t bytes) const { return (bytes / g + N - 1) / N; }
  // What a group's gradients occupy once reduced and kept: all of them (stages 0-1), or this rank's slice (stage 2).
  std::int64_t kept(std::int64_t bytes) const { return sharded_gradients() ? slice_elements(bytes) * g : bytes; }
  // What stays of them on the device after the group's event: what is kept, or nothing when the gradients are offloaded
  // (the tier holds kept(bytes)).
  std::int64_t reduced(std::int64_t bytes) const { return offload_gradients ? 0 : kept(bytes); }
  // Whether a group's gradients shrink on the device at its event (sharded or offloaded).
  bool gradients_leave() const { return sharded_gradients() || offload_gradients; }
  // Gradients alive after the head's event (the head_gradients of one process).
  std::int64_t head_after() const {
    return gradients_leave() ? reduced(head_group) + (tied ? lm_grad : 0) : head_gradients;
  }
  // Gradients alive while layer l is back-propagated: the head's and the layers' after l (reduced) and layer l's own.
  std::int64_t layer_gradients_at(std::int64_t l) const {
    return gradients_leave() ? head_after() + (L - 1 - l) * reduced(layer_grad) + layer_grad
                             : head_gradients + (L - l) * layer_grad;
  }
  // Gradients alive in the embedding backward, before its event: every other group's reduced, the embedding's full.
  std::int64_t embedding_backward_gradients() const {
    return gradients_leave() ? head_after() + L * reduced(layer_grad) + (tied ? 0 : embedding_group) : all_gradients;
  }
  // Gradients the optimizer step sees on the device: every group's reduced.
  std::int64_t step_gradients() const {
    return gradients_leave() ? reduced(head_group) + L * reduced(layer_grad) + reduced(embedding_group)
                             : all_gradients;
  }
  // What a group's collective allocates at its event: stages 0-1 all-reduce a flat copy of its gradients (at::cat);
  // stage 2 packs them into a zeroed [N, slice] buffer and reduce-scatters it into the [slice] it keeps, the backend
  // holding one more copy of the buffer meanwhile (collective_copies).
  std::int64_t reduction_buffers(std::int64_t bytes, bool copies) const {
    if (!sharded_gradients()) return bytes;
    return (N + 1 + (copies ? N : 0)) * slice_elements(bytes) * g;
  }
};

// Throws InputError when `w` is a rank of a sequence-parallel group, for a method whose model does not
// cover one (the methods that do not run on a shard: BackpropMethod::runs_sequence_shards).
void require_whole_sequences(const Workload& w, const std::string& method);

// Sequence parallelism inside Model::attention_block (standard BP and checkpointing; ARCHITECTURE.md §16), on rank 0
// (the shard sizes z.T; its last block ends at the sequence's end), through the workload's K/V exchange (the all-gather
// or the ring: sequence_parallel_memory.cpp picks its terms). What one layer's graph keeps beyond one process's over
// the same positions, and what its attention backward makes; zero / empty when sp == 1.
struct ShardAttention {
  std::int64_t whole_kv = 0;  // the gathered [2, B, n_kv, T, hd], kept by the blocks' attention (the ring: none)
  // Added to one process's activations over the shard (the all-gather: the rotated K and V are not kept, they went
  // into the exchange, the blocks' attention outputs are beside o_proj's input; the ring: its merged output is).
  std::int64_t activations = 0;
};
ShardAttention shard_attention_bytes(const Workload& w);
// A layer's attention backward as the baselines' graphs run it, at its largest moment: one process's
// (attention_backward_terms), or the exchange's over the shard.
std::vector<MemoryTerm> shard_attention_backward_terms(const Workload& w);
// The exchange's moments after a layer's attention backward, each `held` (what the layer's backward holds then) and
// its own terms, named after `layer` (the all-gather: the whole sequence's dK/dV and their reduce-scatter; none when
// sp == 1 or for the ring, whose sums travel inside the attention backward).
std::vector<MemoryEstimate> kv_exchange_backward_moments(const Workload& w, const std::string& layer,
                                                         const std::vector<MemoryTerm>& held);
// A StreamBP layer's backward (its chunk loop) through the workload's K/V source, at its largest moments, each named
// after `layer`: `held` is what the layer's backward holds whatever the source (weights, gradients, checkpoints, dL/dH,
// objective buffers), `sums` its gradient sums so far, `chunk` its worst chunk's moment, of at most `c` rows. One
// process and the all-gather hold the whole sequence's K/V and their sums through the loop (the all-gather its
// exchanges before and after it too); the ring holds its own K/V, blocks and sums in flight.
struct StreamedLayer {
  std::string layer;
  std::vector<MemoryTerm> held;
  std::int64_t sums = 0, chunk = 0, c = 0;
};
std::vector<MemoryEstimate> streamed_layer_moments(const Workload& w, const StreamedLayer& layer);
// The positions this rank holds, as blocks of the sequence: one block [0, T) for one process; under sequence
// parallelism rank 0's zig-zag shard (its last block ends at T, so its last chunk has the most keys).
SequenceShard rank_shard(const Sizes& z);
// The reduce-scatter of the whole sequence's dK/dV ([2, B, n_kv, T, hd], `element_bytes` per element) into this rank's
// share, one piece at a time (SequenceParallel::scatter_sum): the whole gradient, the share, every rank's padded piece
// packed into one [N, ...] buffer (and the backend's clone), the piece summed.
std::vector<MemoryTerm> kv_reduce_scatter_terms(const Workload& w, std::int64_t element_bytes);
// PrefixAndDiagonal's backward of c queries after `prefix` keys (core/model/chunk_attention.cpp), at its largest key
// block: the block's dK/dV (and in bf16 its K/V upcast to fp32), the kernel's scratch, and after the first block the
// dQ summed so far (StreamBP's chunks; the shard's blocks under sequence parallelism).
std::int64_t key_blocks_backward_bytes(const Workload& w, std::int64_t c, std::int64_t prefix);
// The same for `rows` rows (a packed row's run of queries is its own call, one row: packed_attention.h).
std::int64_t key_blocks_backward_bytes(const Workload& w, std::int64_t rows, std::int64_t c, std::int64_t prefix);
// Packed rows (packed_memory.cpp). A StreamBP layer's chunks of c rows starting at [from, to) (multiples of c): the
// largest key_blocks_backward_bytes of any one run of their queries (a run is one row's queries of one sequence; its
// prefix the keys of that sequence before it).
std::int64_t packed_key_blocks_backward_bytes(const Workload& w, std::int64_t c, std::int64_t from, std::int64_t to);
// The whole-sequence methods' attention backward scratch: one call over [B, T] causal, or on packed rows one call per
// sequence and row, the longest's.
std::int64_t whole_sequence_attention_scratch_bytes(const Workload& w);
// Per token, what a whole-sequence layer's graph keeps beyond one process's unpacked rows until o_proj's backward:
// the copy of the runs' outputs that o_proj saves (0 unless packed).
std::int64_t packed_output_copy_bytes_per_token(const Workload& w);
// The shard's loss at its worst moment: each block's log-softmax over its own rows, back-propagated one block after
// another into the [B, t, V] logits' gradient (BackpropMethod::rank_loss); one process's is loss_peak_bytes(T).
std::int64_t shard_loss_peak_bytes(const Workload& w);
// Per token: an RMSNorm's saved tensors; the final norm's (input_kept: a checkpoint holds its input; output_held:
// the caller holds its output).
std::int64_t norm_bytes(std::int64_t width, const Sizes& z);
std::int64_t final_norm_bytes(std::int64_t width, const Sizes& z, bool input_kept, bool output_held = false);
// Cross-entropy over c positions at its worst moment.
std::int64_t loss_peak_bytes(std::int64_t c, const Sizes& z);
// The lm_head's backward over the whole sequence (autograd's linear backward, after the loss's): the logits' gradient
// in the model dtype, and its two GEMMs' outputs and the larger workspace.
std::vector<MemoryTerm> head_gemm_terms(const Workload& w);
// Kernel workspaces, from the workload's calibration: the attention backward's scratch, a GEMM's.
std::int64_t attention_scratch_bytes(const Workload& w, c10::ScalarType dtype, std::int64_t queries, std::int64_t keys,
                                     bool causal, std::int64_t rows = 0);  // rows 0: the workload's batch
std::int64_t gemm_workspace_bytes(const Workload& w, std::int64_t m, std::int64_t n, std::int64_t k, bool a_transposed,
                                  bool b_transposed = false);
// The objective's per-position buffers.
std::int64_t objective_bytes(const Workload& w);
// Checkpoints and gradients alive while layer l is back-propagated, at the two layers where their sum is largest.
struct LayerState {
  std::int64_t layer;
  std::int64_t checkpoints, gradients;
};
std::vector<LayerState> layer_states(const Sizes& z);
// The moment with the most bytes.
MemoryEstimate largest(std::vector<MemoryEstimate> moments);
// The peak of a method that keeps layer checkpoints (StreamBP, checkpointing, MsT): its own moments with the embedding
// backward's and data parallelism's, the largest of them on the device, and the checkpoints the offload tier holds at
// its own peak (MemoryEstimate::host; nothing without offload).
MemoryEstimate checkpointing_peak(std::vector<MemoryEstimate> moments, const Workload& w);
// The offload tier during a step: what it holds at each instant where its sum can be largest, and what it holds the
// whole step. After layer l's event it holds H[0..l-1] and the gradients of the head and of layers l..L-1 (a streamed
// method's order; standard BP fires every event after its backward), linear in l: the instants are the head's event,
// the end (every gradient), layer L-1's and layer 0's events.
struct TierTimeline {
  struct Instant {
    std::int64_t layer;  // after this layer's event; L: the head's event, -1: the end of the backward
    std::vector<MemoryTerm> terms;
  };
  std::vector<Instant> instants;
  std::vector<MemoryTerm> whole_step;
  explicit TierTimeline(const Sizes& z);
  // The instant with the most bytes (its empty terms left out), then the whole step's terms.
  std::vector<MemoryTerm> peak() const;
};
// What the offload tier holds at its own peak during a step (empty without offload): the features' tier terms.
std::vector<MemoryTerm> offload_host_terms(const Workload& w);
// What the third tier (node-local disk) holds at its peak: the checkpoints beyond an Offload's host_layers, written by
// the forward and read back by the backward (empty without a disk tier); their bytes.
std::vector<MemoryTerm> offload_disk_terms(const Workload& w);
std::int64_t offload_disk_bytes(const Workload& w);
// A training step's moments beside its BP (core/training/training_memory.h): the update's, those the features add
// around it, and the offload tier's terms beside the BP's.
struct StepMoments {
  std::vector<MemoryEstimate> moments;
  std::vector<MemoryTerm> host;
};
void add_feature_step_moments(const Workload& w, StepMoments& step);
// RoPE's cos and sin tables of `positions` positions.
std::int64_t rope_table_bytes(const Workload& w, std::int64_t positions);
// RMSNorm's saved statistics per token; one full-sequence layer's saved tensors per token.
std::int64_t norm_statistics_bytes_per_token(const Workload& w);
std::int64_t full_sequence_layer_bytes_per_token(const Workload& w, bool input_kept, bool input_saved = true);
// The MLP backward's extra gradient over `tokens` positions; SDPA's backward over the full sequence.
std::int64_t mlp_backward_bytes(const Workload& w, std::int64_t tokens);
std::vector<MemoryTerm> attention_backward_terms(const Workload& w);
// The embedding backward's moment (empty under LoRA).
MemoryEstimate embedding_moment(const Workload& w);
// The streamed head's moments (StreamBP and MsT), its statistics pass included.
std::vector<MemoryEstimate> streamed_head_moments(const Workload& w, std::int64_t head_chunk);
// Every moment the workload's features add to a method's (none for one process, e.g. data parallelism's collectives
// at the gradient-ready events and ZeRO-3's gathers). streamed: the method fires its events between layers (all but
// standard BP).
std::vector<MemoryEstimate> feature_moments(const Workload& w, bool streamed);
// ZeRO-3's gathers of the trainable tensors, or one process's fetches of them from the offload tier (none when they
// stay on the device).
std::vector<MemoryEstimate> parameter_gather_moments(const Workload& w, bool streamed);

}  // namespace sbp::memory
