// StreamBP (Luo et al. 2025): exact backpropagation streamed along the sequence, layer by layer (ARCHITECTURE.md §4).
// Memory: weights + gradients + one [B, T, d] checkpoint per layer + one layer's K/V and their gradients + the
// working set of one layer chunk and of one head chunk; never a [T, T] tile, never full-T logits.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/methods/flop_model.h"
#include "core/methods/method.h"

namespace sbp {

class ChunkGradients;
struct HeadResult;
struct KVGradSums;
// Not final: its protected virtual steps (attend, head_and_loss, stream_layer_backward, kv_path_backward,
// accumulation_dtype) are where the negative controls' faulty subclasses (tests/support/faulty_methods.h) put their bugs.
class StreamBP : public BackpropMethod {
 public:
  struct Options {
    std::int64_t layer_chunk = 512;  // tokens per chunk inside a decoder layer (c)
    std::int64_t head_chunk = 1024;  // tokens per chunk of the LM head + loss (c_h)
  };

  explicit StreamBP(Options options) : options_(options) {}
  std::string spec() const override;
  bool keeps_layer_checkpoints() const override { return true; }
  bool runs_sequence_shards() const override { return true; }
  MemoryEstimate memory_model(const Workload& workload) const override;
  double flops(const Workload& workload) const override { return streambp_flops(workload, options_.head_chunk); }
  std::vector<PhaseFlops> phase_flops(const Workload& workload) const override {
    return streambp_phase_flops(workload, options_.head_chunk);
  }
  const Options& options() const { return options_; }

  // The two chunk bodies of a layer's streamed backward, written once: the method's loops call them, and the bench
  // (experiments/bench.cpp) times them. `params` are the layer's trainable tensors; each returns the gradient of the
  // chunk's rows of the layer input, then those of `params` (undefined where a tensor is unused). `position`: the
  // global position of row s (s itself but on a sequence-parallel rank, whose rows are its shard's).
  // Step 2, rows [s, e) of the layer input h_in: the Q path, attention over K/V[..., :position + c] (the prefix's
  // dK/dV added into `sums`), o_proj and the MLP with a graph, back-propagated from grad_out ([B, c, d]).
  std::vector<at::Tensor> layer_chunk_backward(const Model& model, int layer, const at::Tensor& h_in, std::int64_t s,
                                               std::int64_t e, std::int64_t position, const at::Tensor& K,
                                               const at::Tensor& V, const KVGradSums& sums,
                                               const at::Tensor& grad_out, const std::vector<at::Tensor>& params) const;
  // Step 3, the same rows: k and v recomputed with a graph and back-propagated from dK/dV's rows (rounded to the
  // model dtype here, their only rounding).
  std::vector<at::Tensor> kv_chunk_backward(const Model& model, int layer, const at::Tensor& h_in, std::int64_t s,
                                            std::int64_t e, std::int64_t position, const at::Tensor& dK,
                                            const at::Tensor& dV, const std::vector<at::Tensor>& params) const;

 protected:
  // The LM head + loss per head chunk (streamed_head): the loss and dLoss/dH[L]; commits the head's gradients.
  virtual HeadResult head_and_loss(const Model& model, const PreparedObjective& objective, const at::Tensor& h_last,
                                   PhaseClock& clock) const;
  // One layer's exact backward, streamed: g holds dLoss/dH_out [B, T, d] on entry and dLoss/dH_in on return. Each
  // chunk reads its own rows of dLoss/dH_out once (the layer is position-wise outside attention, whose K/V
  // gradients go to the sums), so its input gradient overwrites them: no second [B, T, d] buffer.
  virtual void stream_layer_backward(const Model& model, int layer, const at::Tensor& h_in, at::Tensor& g,
                                     PhaseClock& clock) const;
  // The chunk's attention over K/V[..., :q_start + c, :], its K/V gradients added into `sums`.
  virtual at::Tensor attend(const Model& model, const at::Tensor& q, const at::Tensor& K, const at::Tensor& V,
                            std::int64_t q_start, const KVGradSums& sums) const;
  // Step 3 of a layer's backward: dK/dV [B, n_kv, T, hd] (every chunk's share summed) pushed through the K/V path of
  // each chunk into g (dLoss/dH_in) and the layer's weight gradients.
  virtual void kv_path_backward(const Model& model, int layer, const at::Tensor& h_in, const at::Tensor& dK,
                                const at::Tensor& dV, at::Tensor& g, ChunkGradients& weights, PhaseClock& clock) const;
  // The dtype dK/dV and the layer's weight gradients are summed over chunks in, for gradients in `dtype`: fp32 for
  // bf16 (ChunkGradients::accumulation_dtype).
  virtual c10::ScalarType accumulation_dtype(c10::ScalarType dtype) const;

 private:
  double backprop(Model& model, const PreparedObjective& objective, const Batch& batch, PhaseClock& clock) override;

  Options options_;
};

// Advice when `method` is StreamBP with a chunk at least T long ("" otherwise): the sequence is then one chunk and
// nothing streams (the paper's 500 and 100 tokens are for T in the tens of thousands; on tiny at T = 128 they are
// checkpointing by another name).
std::string streambp_chunk_advice(const BackpropMethod& method, std::int64_t seq_len);

struct MethodEntry;
MethodEntry streambp_entry();  // its entry in the catalogue (baselines/methods.h)

}  // namespace sbp
