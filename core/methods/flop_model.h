// Analytic FLOP counts of each BP method's step (matrix products only, 2 FLOPs per multiply-add): what the method
// computes, recomputation included, so that FLOPs / BP time is its achieved rate, comparable with the machine's dense
// GEMM rate (issue #9's efficiency columns). Element-wise work (norms, RoPE, SiLU, softmax) is not counted: it is
// what keeps a method below the GEMM rate.
#pragma once

#include <cstdint>
#include <vector>

#include "core/methods/method.h"

namespace sbp {

// The pieces, for B rows of T tokens (N = B·T), per step:
struct FlopTerms {
  double layer_base = 0, layer_adapters = 0;  // one forward of every decoder layer's projections; of their adapters
  double kv_base = 0, kv_adapters = 0;        // the K and V projections' share of those (StreamBP repeats them)
  // One causal forward of every layer's attention: QKᵀ and PV over T(T+1)/2 pairs per head and row (packed rows:
  // Σ L(L+1)/2 over their sequences).
  double attention = 0;
  double head = 0;        // one forward of the LM head: N·d·V multiply-adds
  double base_backward = 2, head_backward = 2;  // backward / forward: 2 when the weights train, 1 when frozen
  double first_layer_skipped = 0;  // what standard BP under LoRA never computes (flop_terms)
  // Flash backward: S recomputed, dV, dP, dQ, dK: 5 products of head_dim per pair vs the forward's 2 (ATen's CPU
  // flash backward runs these five GEMMs per tile; tests/unit/test_flop_model.cpp counts the pairs of every call).
  static constexpr double kAttentionBackward = 2.5;
  // Forward (and backward) of projections with these base and adapter FLOPs.
  double projections(double base, double adapters, bool with_backward) const;
};
FlopTerms flop_terms(const Workload& w);

double standard_flops(const Workload& w);
double checkpoint_flops(const Workload& w);  // standard + one re-forward of every layer
double mst_flops(const Workload& w);         // checkpointing's, plus the streamed head's statistics pass
// StreamBP: the chunked forward and step 2 score each chunk's queries against its key prefix in full and its
// diagonal block causally, so each pass is the causal T(T+1)/2 pairs per head whatever the chunk size (as
// checkpointing's forward + re-forward); K/V are projected in the forward, in step 1 and again in step 3.
// With head chunks of `head_chunk` tokens: the statistics pass runs where the objective needs it and one chunk does not
// hold the sequence (streamed_head); 0: wherever the objective needs it.
double streambp_flops(const Workload& w, std::int64_t head_chunk = 0);
// The same by StreamBP's phases (their PhaseClock names): forward, statistics, head, kv_recompute (step 1), layer
// (step 2, attention's re-forward and backward in it) and kv_path (step 3); the embedding's backward is no product.
// They sum to streambp_flops.
std::vector<PhaseFlops> streambp_phase_flops(const Workload& w, std::int64_t head_chunk = 0);
double streambp_attention_flops(const Workload& w);  // its attention share
// One decoder layer's backward in StreamBP (steps 1-3: K/V, the chunks' re-forward and backward, the K/V path; its
// attention's re-forward and backward), the average over the L layers: what the device computes while the next
// layer's checkpoint comes back (the disk tier's stall factor, `project --disk-bytes-per-node`).
double streambp_layer_backward_flops(const Workload& w);

}  // namespace sbp
