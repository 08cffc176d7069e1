// Qwen3-family dense decoder (HF modeling_qwen3 semantics), exposed as the position-wise pieces every BP method
// composes (ARCHITECTURE.md §3):
//   kv(h, start)               input norm, k/v projection, k-norm, RoPE      h: [B, c, d] -> k, v: [B, n_kv, c, hd]
//   q(h, start)                input norm, q projection, q-norm, RoPE        h: [B, c, d] -> q: [B, n_h, c, hd]
//   attend(q, k, v, q_start)   causal attention, bottom-right aligned        -> o: [B, c, n_h*hd]
//   after_attention(h, o)      o-proj, residual, post-norm, MLP, residual    -> h_out: [B, c, d]
// `start` / `q_start` is the absolute position of the chunk's first token. The full-sequence forward is the same
// pieces applied to one chunk [0, T).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/model/config.h"
#include "core/model/kv_source.h"
#include "core/model/lora.h"
#include "core/io/safetensors.h"  // NamedTensor: an HF tensor name and its tensor
#include "core/io/input_error.h"

namespace sbp {

struct KVGradSums;  // core/model/chunk_attention.h
class PackedRows;  // core/model/packed_rows.h

struct LayerWeights {
  at::Tensor input_norm;            // [d]
  at::Tensor q_w, q_b;              // [n_h*hd, d], [n_h*hd] (bias only with attention_bias)
  at::Tensor k_w, k_b, v_w, v_b;    // [n_kv*hd, d], [n_kv*hd]
  at::Tensor o_w, o_b;              // [d, n_h*hd], [d] (bias only with o_proj_bias)
  at::Tensor q_norm, k_norm;        // [hd] (only with qk_norm)
  at::Tensor post_norm;             // [d]
  at::Tensor gate_w, up_w, down_w;  // [I, d], [I, d], [d, I]
  struct Lora {
    at::Tensor A, B;  // [r, in], [out, r]
  };
  std::map<std::string, Lora> lora;  // by target (q, k, v, o, gate, up, down); empty without LoRA
};

class Model {
 public:
  // Seeded random init: normal(0, 0.02) like HF's _init_weights for matrices; unlike HF (zero biases, unit norms)
  // biases are N(0, 0.02²) and norm weights 1 + N(0, 0.02²), so that every parameter's role in the forward is
  // exercised by the gradient checks. Drawn in fp32, then cast: one seed gives the same weights in every dtype.
  Model(ModelConfig config, c10::ScalarType dtype, std::uint64_t seed);
  // Weights from HF-named tensors (cast to dtype). Throws naming the missing/unexpected tensor or wrong shape.
  Model(ModelConfig config, c10::ScalarType dtype, const std::vector<NamedTensor>& tensors,
        const std::string& source);

  const ModelConfig& config() const { return config_; }
  // The compute dtype: every op runs in it (weights, activations, K/V, the gradients flowing between layers).
  c10::ScalarType dtype() const { return dtype_; }
  // The dtype of the trainable tensors and their gradients: dtype() by default; fp32 for a bf16/fp16 model in mixed
  // precision (--grad-dtype fp32), where the trainable tensors are fp32 masters cast to the compute dtype where they
  // are used (like torch.autocast: the forward is the compute-dtype model on rounded masters; each weight gradient
  // leaves its compute-dtype GEMM once rounded and is summed in fp32). A frozen base (LoRA) stays in dtype().
  c10::ScalarType grad_dtype() const { return grad_dtype_; }
  // Re-stores the trainable tensors in `dtype` (fp32 masters, or back to dtype()); call with no gradients alive.
  // Throws InputError unless dtype is dtype(), or fp32 for a bf16/fp16 model.
  void set_grad_dtype(c10::ScalarType dtype);
  // Where the weights live (a model is built on the CPU, from one seed for every device, then moved).
  c10::Device device() const { return embed_.device(); }
  // Moves every parameter and adapter to `device`; call with no gradients alive. Adapters added later are created
  // there too.
  void to(c10::Device device);
  // Every base parameter once (a tied lm_head is the embedding), in HF names and order.
  const std::vector<NamedTensor>& parameters() const { return parameters_; }
  // What a step trains: the base parameters, or under LoRA only the adapters (PEFT names; the base is frozen and
  // has no gradient buffers).
  const std::vector<NamedTensor>& trainable() const { return lora_.enabled() ? adapters_ : parameters_; }
  std::vector<NamedTensor> gradients() const;  // of trainable(), same names; zeros where a grad is undefined
  void zero_grad();                                // trainable grads become undefined (freed), like set_to_none

  // LoRA on config.targets of every layer: fresh adapters drawn from `seed` (config.init), or PEFT-named tensors
  // (throws naming `source` and the missing, unexpected or misshapen tensor). Freezes the base.
  void add_lora(const LoraConfig& config, std::uint64_t seed);
  void load_lora(const LoraConfig& config, const std::vector<NamedTensor>& tensors, const std::string& source);
  const LoraConfig& lora() const { return lora_; }
  const std::vector<NamedTensor>& adapters() const { return adapters_; }
  // While alive, the model computes its base function (adapters off): the reference policy under LoRA, with no
  // second copy of the weights.
  class AdaptersDisabled {
   public:
    explicit AdaptersDisabled(const Model& model) : model_(model), was_(model.adapters_enabled_) {
      model.adapters_enabled_ = false;
    }
    ~AdaptersDisabled() { model_.adapters_enabled_ = was_; }
    AdaptersDisabled(const AdaptersDisabled&) = delete;
    AdaptersDisabled& operator=(const AdaptersDisabled&) = delete;

   private:
    const Model& model_;
    bool was_;
  };

  // While alive, the model's rows are packed (core/model/packed_rows.h): RoPE rotates each column at its position in
  // its own sequence, and attend/attention_block let each sequence attend causally within itself only. Null: one
  // sequence per row. BackpropMethod::step holds one for its batch; `rows` outlives it.
  class PackedRowsInUse {
   public:
    PackedRowsInUse(const Model& model, const PackedRows* rows) : model_(model), was_(model.packed_rows_) {
      model.packed_rows_ = rows;
    }
    ~PackedRowsInUse() { model_.packed_rows_ = was_; }
    PackedRowsInUse(const PackedRowsInUse&) = delete;
    PackedRowsInUse& operator=(const PackedRowsInUse&) = delete;

   private:
    const Model& model_;
    const PackedRows* was_;
  };
  const PackedRows* packed_rows() const { return packed_rows_; }

  at::Tensor embed(const at::Tensor& input_ids) const;                                 // [B, c] -> [B, c, d]
  // Back-propagates dLoss/d(embed(input_ids)) ([B, T, d]) into the embedding gradient in place (tied: the lm_head's,
  // no dense [V, d] temporary); nothing when frozen.
  void embed_backward(const at::Tensor& input_ids, const at::Tensor& grad) const;
  std::pair<at::Tensor, at::Tensor> kv(int layer, const at::Tensor& h, std::int64_t start) const;
  at::Tensor q(int layer, const at::Tensor& h, std::int64_t start) const;
  // With `sums` (StreamBP's backward) k and v are constants and their gradients are added into the sums
  // (chunk_attention.h); without, they flow through autograd.
  at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::int64_t q_start,
                    const KVGradSums* sums = nullptr) const;
  // 1 / sqrt(head_dim): attend's, and what a K/V source's attention is given.
  double attention_scale() const;
  // What a K/V source that cuts the attention itself is given: the scale and the packed rows in use (if any).
  AttentionRule attention_rule() const;
  at::Tensor after_attention(int layer, const at::Tensor& h, const at::Tensor& o) const;
  // One decoder layer on a chunk whose keys are exactly the chunk (start 0): the pieces composed, as
  // mlp_block(attention_block(h)).
  at::Tensor layer_forward(int layer, const at::Tensor& h) const;
  // The two halves of layer_forward (MsT keeps them apart: full-sequence attention, MLP in mini-sequences):
  //   attention_block(h) = h + o_proj(attention(h))              [B, T, d] -> h_mid [B, T, d]
  //   mlp_block(h_mid)   = h_mid + MLP(post_norm(h_mid))         position-wise: any chunk of h_mid
  at::Tensor attention_block(int layer, const at::Tensor& h) const;
  at::Tensor mlp_block(int layer, const at::Tensor& h_mid) const;
  at::Tensor final_norm(const at::Tensor& h) const;  // [B, c, d]
  // The blocks a streamed head reuses for every chunk (grown when too small): the logits in the compute dtype and,
  // for a bf16/fp16 model, the GEMM's product in the model dtype, which logits_backward reuses for the gradient it
  // rounds. A fresh [B, c_h, V] block per chunk would pay its page faults every time (measured in
  // results/bench/README.md: 15% of a bf16 StreamBP step on qwen3-small).
  struct HeadBuffers {
    at::Tensor logits, product;
  };
  // Logits in compute_dtype (fp32 for bf16/fp32 models, like HF's loss upcast; fp64 stays fp64). [B, c, V]
  // With `buffers`: written into them and returned as a view of buffers->logits.
  at::Tensor logits(const at::Tensor& h_normed, HeadBuffers* buffers = nullptr) const;
  // Backward of logits(h_normed) by hand, for a streamed head: adds dLoss/dW = grad^T · h_normed into `lm_sum`
  // ([V, d], created on the first chunk; fp32 for a bf16 model, see ChunkGradients) inside one GEMM (addmm, beta = 1:
  // no [V, d] temporary for fp32/fp64) and returns dLoss/dh_normed = grad · W. Nothing is summed when the lm_head is
  // frozen. grad_logits: [B, c, V] in compute dtype; h_normed: [B, c, d]. With `buffers` (those of logits()), a
  // bf16 model rounds the gradient into buffers->product instead of a new block.
  at::Tensor logits_backward(const at::Tensor& grad_logits, const at::Tensor& h_normed, at::Tensor& lm_sum,
                             HeadBuffers* buffers = nullptr) const;
  // Vocabulary rows per block of a bf16 lm_head gradient sum (logits_backward).
  static constexpr std::int64_t kLmHeadRows = 4096;
  // Adds a streamed head's lm_sum into the lm_head gradient (rounding it once into the model dtype).
  void commit_lm_head_gradient(at::Tensor& lm_sum) const;
  const at::Tensor& lm_head_weight() const { return lm_head_; }
  const at::Tensor& final_norm_weight() const { return norm_; }
  // The trainable tensors of decoder layer `layer` (its weights, or its adapters under LoRA): what a streamed
  // layer backward sums over chunks.
  std::vector<at::Tensor> layer_trainable(int layer) const;
  // What the head's backward finishes: the final norm's weight and an untied lm_head (none under LoRA); and what the
  // embedding's backward finishes last: the embedding (tied: the lm_head too, one tensor). Frozen tensors left out.
  std::vector<at::Tensor> head_trainable() const;
  std::vector<at::Tensor> embedding_trainable() const;

  // Where attention_block's K/V come from (ARCHITECTURE.md §16), and what the methods ask about the rows they hold:
  // the local source (whole sequences) unless another is set. An exchange makes attention_block work on this rank's
  // shard of the sequence ([B, t, d], the shard's positions in order): RoPE at each block's global positions, the K/V
  // all-gathered over the group, their gradients reduce-scattered in the backward. Every other piece is
  // position-wise. `source` outlives its use; nullptr: the local source again.
  void set_kv_source(KVSource* source) { kv_source_ = source ? source : &local_kv_source(); }
  KVSource& kv_source() const { return *kv_source_; }

 private:
  void register_parameters();
  void attach_adapters();  // layers_[i].lora from adapters_
  // A weight (or gathered rows) in the compute dtype: the identity unless it is a wider master (grad_dtype()).
  at::Tensor compute(const at::Tensor& t) const;
  // at::linear(x, W, b), plus (alpha/r)·B(A x) when `target` carries an enabled adapter (PEFT's order of operations).
  at::Tensor project(const LayerWeights& w, const char* target, const at::Tensor& x, const at::Tensor& weight,
                     const at::Tensor& bias = {}) const;
  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight) const;
  at::Tensor rope(const at::Tensor& x, std::int64_t start) const;  // x: [B, heads, c, hd]
  // The projections after the input norm; kv()/q() norm first, layer_forward() norms once for both (as HF does).
  std::pair<at::Tensor, at::Tensor> kv_from_normed(const LayerWeights& w, const at::Tensor& hn, std::int64_t start) const;
  at::Tensor q_from_normed(const LayerWeights& w, const at::Tensor& hn, std::int64_t start) const;

  ModelConfig config_;
  c10::ScalarType dtype_;
  c10::ScalarType grad_dtype_;
  at::Tensor embed_;    // [V, d]
  at::Tensor lm_head_;  // [V, d]; the same tensor as embed_ when tied
  at::Tensor norm_;     // [d]
  std::vector<LayerWeights> layers_;
  at::Tensor inv_freq_;  // [hd/2] fp32
  std::vector<NamedTensor> parameters_;
  LoraConfig lora_;
  std::vector<NamedTensor> adapters_;
  mutable bool adapters_enabled_ = true;
  mutable const PackedRows* packed_rows_ = nullptr;
  KVSource* kv_source_ = &local_kv_source();
};

// "model.layers.{i}." prefix etc. live in model.cpp; this lists (name, shape) for a config, in HF order.
std::vector<std::pair<std::string, std::vector<std::int64_t>>> parameter_shapes(const ModelConfig& config);

}  // namespace sbp
