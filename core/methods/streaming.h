// The streamed building blocks that several methods and the reference pass share: chunk loops, the chunked
// no-grad layer forward, the objective's statistics pass, and per-token log-probs of a model on its own hidden
// states (the reference policy, ARCHITECTURE.md §5).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/model/chunk_gradients.h"

namespace sbp {

class Model;
class PhaseClock;
class PreparedObjective;
struct Batch;

// Chunk boundaries [s, e) covering [0, T); the last chunk is the remainder when c does not divide T.
template <typename F>
void for_each_chunk(std::int64_t T, std::int64_t c, F&& f) {
  for (std::int64_t s = 0; s < T; s += c) f(s, std::min(T, s + c));
}

// Chunks of at most c of the positions this process holds, h's rows [0, T): f(s, e, position) with [s, e) the rows
// and `position` the global position of row s (Model::kv_source: locally position == s; on a sequence-parallel rank
// the rows are its shard's positions in order and a chunk never crosses one of its blocks).
void for_each_rank_chunk(const Model& model, std::int64_t T, std::int64_t c,
                         const std::function<void(std::int64_t s, std::int64_t e, std::int64_t position)>& f);

// K and V of decoder layer `layer` for the rows h [B, t, d] this process holds, without a graph, c tokens at a time
// (the projection, k-norm and RoPE are position-wise): [2, B, n_kv, t, hd], K and V in one block as a K/V source takes
// them, with chunk-sized temporaries only (the whole-sequence call made a normed [B, T, d] copy and several
// [B, T, n_kv*hd] temporaries at once).
at::Tensor kv_chunked(const Model& model, int layer, const at::Tensor& h, std::int64_t chunk);

// Decoder layer `layer` on h [B, T, d] without a graph, c tokens at a time: K/V of the rows once, then per chunk the Q
// path, attention over the prefix (as the model's K/V source serves the keys) and the MLP. Returns [B, T, d]; no full-T MLP intermediate exists.
at::Tensor layer_forward_chunked(const Model& model, int layer, const at::Tensor& h, std::int64_t layer_chunk);

// o [B, n_h, c, hd] -> [B, c, n_h*hd], as Model::attend hands it to after_attention.
at::Tensor attention_rows(const at::Tensor& o);

// Pass 1 of ARCHITECTURE.md §5, when objective.needs_statistics(): final norm + logits per head chunk, no grad, into the
// objective's row statistics (summed over a sequence-parallel group); returns the objective completed with them.
// h_last: [B, T, d], the last decoder layer's output.
PreparedObjective statistics_pass(const Model& model, const PreparedObjective& objective, const at::Tensor& h_last,
                                  std::int64_t head_chunk);

struct HeadResult {
  double loss = 0;  // the objective's value: the sum of the chunk terms
  at::Tensor grad;  // dLoss/dh_last: [B, T, d]
};
// The LM head + loss streamed over head chunks of c_h positions (StreamBP and MsT share it): the statistics pass
// first when the objective needs one (phase "statistics"), then per chunk final norm + logits (one [B, c_h, V]
// buffer), the objective's in-place gradient, and the head backward by hand — the lm_head gradient accumulates
// inside the GEMM.
HeadResult streamed_head(const Model& model, const PreparedObjective& objective, const at::Tensor& h_last,
                         std::int64_t head_chunk, PhaseClock& clock);

// logp[b, t] = log_softmax(logits[b, t - 1] / temperature)[input_ids[b, t]] for t >= 1, column 0 = 0: [B, T] fp64.
// A chunked no-grad pass of `model` on its own hidden states; never holds more than [B, head_chunk, V] logits.
at::Tensor sequence_logps(const Model& model, const at::Tensor& input_ids, double temperature,
                          std::int64_t layer_chunk = 512, std::int64_t head_chunk = 1024);
// The same of a batch's tokens, read as its rows say (packed rows: each sequence within itself, from position 0). A
// packed sequence's first column is its predecessor's last position's prediction: meaningless, and never scored.
at::Tensor sequence_logps(const Model& model, const Batch& batch, double temperature, std::int64_t layer_chunk = 512,
                          std::int64_t head_chunk = 1024);

}  // namespace sbp
