// Analytic peak memory (ARCHITECTURE.md §7). Each method's model (BackpropMethod::memory_model) is the largest of a
// few moments of its step, each a sum of named terms that follow what autograd keeps alive at that moment, and sits
// beside the method's code (core/methods/streambp_memory.cpp, baselines/*_memory.cpp), written in the shared terms
// of memory_terms.h; the measured peak is printed next to it, so a drift between code and model shows up at once.
// Here: the per-token terms the drivers and tests read, and the reference pass's model.
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

// The reference pass (sequence_logps): the weights of a reference model loaded for it (separate_weights; under LoRA
// the policy's own base serves), two [B, T, d] hidden states, one layer's K/V and chunk, or one head chunk's logits
// with their log-sum-exp temporary.
MemoryEstimate reference_pass_memory(const Workload& w, std::int64_t layer_chunk, std::int64_t head_chunk,
                                     bool separate_weights);

}  // namespace sbp
