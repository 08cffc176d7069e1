// Training objectives, one code path for every BP method (DESIGN §5). A method feeds the objective the logits of
// a chunk of positions; the chunk terms sum to the loss and so do their gradients. Everything that couples tokens
// (valid-label counts, per-sequence statistics) is fixed in prepare(), before any chunk.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "core/batch.h"

namespace sbp {

class Objective {
 public:
  virtual ~Objective() = default;
  virtual std::string name() const = 0;
  virtual void prepare(const Batch& batch) = 0;
  // logits: [B, c, V] for positions [start, start + c), in compute dtype. Returns a 0-dim loss term.
  virtual at::Tensor chunk_loss(const at::Tensor& logits, std::int64_t start) const = 0;
  // The chunk's loss term, with `logits` overwritten by dLoss/dlogits: what a streamed head needs, without
  // autograd's copies of [B, c, V]. This default runs autograd on chunk_loss (two more [B, c, V] buffers at its
  // peak); an objective may override it with an in-place computation.
  virtual double chunk_loss_and_grad(at::Tensor& logits, std::int64_t start) const;
};

// SFT with HF's convention: position t predicts labels[t+1]; loss = sum of NLL / number of valid shifted labels in
// the whole batch (not per chunk, not per row).
class SftObjective final : public Objective {
 public:
  std::string name() const override { return "sft"; }
  void prepare(const Batch& batch) override;
  at::Tensor chunk_loss(const at::Tensor& logits, std::int64_t start) const override;
  // In place: softmax - onehot(target), scaled by 1/num_valid on valid rows, zero on ignored ones. One [B, c, V]
  // buffer (the logits themselves) instead of three at the peak, so head chunks can be three times longer.
  double chunk_loss_and_grad(at::Tensor& logits, std::int64_t start) const override;
  std::int64_t num_valid_labels() const { return num_valid_; }

 private:
  at::Tensor shifted_labels_;  // [B, T]: labels[:, 1:] then -100
  std::int64_t num_valid_ = 0;
};

std::unique_ptr<Objective> make_objective(const std::string& name);  // throws naming the known objectives

}  // namespace sbp
