// Analytic peak memory of each BP method (DESIGN §4 floor, and its counterparts for the baselines). Each model is
// the largest of a few moments of the step, each a sum of named terms that follow what autograd keeps alive at
// that moment; the measured peak is printed next to it, so a drift between code and model shows up at once.
#pragma once

#include <cstdint>
#include <vector>

#include "core/methods/method.h"

namespace sbp {

// Bytes autograd keeps per token for one decoder layer run with a graph on the full sequence (LoRA included).
std::int64_t layer_activation_bytes_per_token(const Workload& w, bool input_kept = false);
// Its two halves: attention_block (input norm, q/k/v, attention, o-proj input) and mlp_block (post norm, MLP).
std::int64_t attention_activation_bytes_per_token(const Workload& w, bool input_kept = false);
std::int64_t mlp_activation_bytes_per_token(const Workload& w);

MemoryEstimate standard_memory(const Workload& w);
MemoryEstimate checkpoint_memory(const Workload& w);
MemoryEstimate streambp_memory(const Workload& w, std::int64_t layer_chunk, std::int64_t head_chunk);
MemoryEstimate mst_memory(const Workload& w, std::int64_t mini_seq_len);
// A training step of `method`: its BP moments with the optimizer's states beside them, or the optimizer's update
// (weights, every gradient, the states and the update's temporaries), whichever is larger. Without optimizer bytes
// in the workload: the method's own model.
MemoryEstimate training_memory(const BackpropMethod& method, const Workload& w);
// The optimizer's bytes of a workload that has no model to look at (projections): its trainable elements (every
// weight, or the LoRA adapters) as tensors no larger than the largest one (the [V, d] embedding, or a rank x I
// adapter), in the gradient dtype. Exact for the states; the update's temporaries follow the largest tensor.
// Data-parallel at ZeRO stage >= 1 (w.world_size, w.zero_stage): this rank's slice of each tensor.
struct OptimizerOptions;
void add_projected_optimizer(Workload& w, const OptimizerOptions& options);
// What the optimizer of rank 0 holds under w's ZeRO stage: each tensor's slice of ceil(numel / N) elements
// (DataParallel::optimizer_params) at stages >= 1, `params` unchanged otherwise.
struct ParamShape;
std::vector<ParamShape> optimizer_shard(const std::vector<ParamShape>& params, const Workload& w);

// The reference pass (sequence_logps): the weights of a reference model loaded for it (separate_weights; under LoRA
// the policy's own base serves), two [B, T, d] hidden states, one layer's K/V and chunk, or one head chunk's logits
// with their log-sum-exp temporary.
MemoryEstimate reference_pass_memory(const Workload& w, std::int64_t layer_chunk, std::int64_t head_chunk,
                                     bool separate_weights);

}  // namespace sbp
