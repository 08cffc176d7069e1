// The one interface every BP method implements (standard, checkpoint, MsT, StreamBP). Drivers and checkers only
// see this: they never branch on the concrete method.
#pragma once

#include <chrono>
#include <functional>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include "core/objectives/batch.h"
#include "core/model/config.h"
#include "core/methods/event_hooks.h"
#include "core/methods/kernel_workspace.h"
#include "core/methods/layer_checkpoints.h"
#include "core/objectives/objective.h"
#include "core/methods/phase.h"
#include "core/methods/workload.h"

namespace sbp {

class Model;
class OffloadTier;

struct StepResult {
  double loss = 0;        // value of the objective (sum of the chunk terms for streamed methods)
  double bp_seconds = 0;  // forward + backward, excluding any optimizer
  std::vector<PhaseTime> phases;
  // What every method returns at the end of its step: the loss, the time since `start` (after waiting for the
  // device's queued work: CUDA kernels run after their launch returns), the clock's phases.
  static StepResult finish(double loss, std::chrono::steady_clock::time_point start, const PhaseClock& clock,
                           c10::Device device) {
    synchronize(device);
    return {loss, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), clock.totals()};
  }
};

// A group of trainable tensors whose gradients the running step has finished (ARCHITECTURE.md §11): a decoder layer's
// ("layer.5"), the head's ("head": final norm, untied lm_head), the embedding's ("embedding": tied, the lm_head's
// too). Where a distributed reduction or a per-layer optimizer step attaches. Fired once per group and step (each
// micro-batch's step when accumulating), never for a group without trainable tensors.
struct GradientGroup {
  std::string name;
  std::vector<at::Tensor> tensors;
};
using GradientReadyFn = std::function<void(const GradientGroup&)>;

// A group's trainable tensors are about to be used (`begin`) or no longer needed (!begin): where ZeRO-3 gathers the
// sharded parameters and frees them again (ARCHITECTURE.md §12). The embedding and head groups span a whole step (they are
// used at both of its ends); a decoder layer's uses are its forward and, separately, its backward (for StreamBP the
// whole chunk loop: gathered once, kept to the last chunk). Begins and ends pair up, possibly nested.
struct ParameterUse {
  std::string name;
  std::vector<at::Tensor> tensors;
  bool begin = true;
};
using ParameterUseFn = std::function<void(const ParameterUse&)>;

struct StepOptions {
  // Add into the gradients already there (the micro-batches of one optimizer step) instead of freeing them first.
  bool accumulate = false;
  // Normalise the objective by the optimizer step's totals instead of the batch's own (Objective::prepare).
  std::optional<StepTotals> step_totals;
};

class BackpropMethod {
 public:
  virtual ~BackpropMethod() = default;
  // Canonical spec; make_method(spec()) builds the same method.
  virtual std::string spec() const = 0;
  // What every method's step does, in one place: frees the model's gradients (unless options.accumulate), prepares
  // the objective on `batch` (the prepared objective lives for this step), runs forward + backward (backprop) under
  // the clock and leaves the exact gradient of the objective in every trainable tensor's grad() (added to what was
  // there when accumulating).
  StepResult step(Model& model, const Objective& objective, const Batch& batch, const StepOptions& options = {});
  // `fn` is called at every group's gradient-ready moment of the following steps while the subscription lives (after
  // the earlier subscribers'). The method outlives the subscription.
  [[nodiscard]] Subscription on_gradient_ready(GradientReadyFn fn) { return gradient_ready_.subscribe(std::move(fn)); }
  // `fn` is called where the following steps start and stop using each group's parameters, while the subscription
  // lives.
  [[nodiscard]] Subscription on_parameter_use(ParameterUseFn fn) { return parameter_use_.subscribe(std::move(fn)); }
  // The following steps keep their layer checkpoints in `tier` (null: on the device), for a method that keeps
  // checkpoints (StreamBP, checkpointing, MsT: LayerCheckpoints); standard BP keeps a whole graph and ignores it. The
  // tier outlives the steps. A copy, never arithmetic: the gradients are the same bits with and without it.
  void offload_checkpoints_to(OffloadTier* tier) { checkpoint_tier_ = tier; }
  // Whether the method keeps layer checkpoints that offload_checkpoints_to can move (false: it ignores the tier).
  virtual bool keeps_layer_checkpoints() const { return false; }
  // Whether the method runs on one rank's shard of a sequence split over a sequence-parallel group
  // (a Model::kv_source that is not local; ARCHITECTURE.md §16). step() refuses the others on such a source, and
  // their memory_model refuses such a workload (Workload::sequence_parallel() > 1) rather than answer for whole
  // sequences.
  virtual bool runs_sequence_shards() const { return false; }
  // Analytic peak bytes of step() (weights and gradients included).
  virtual MemoryEstimate memory_model(const Workload& workload) const = 0;
  // Analytic matrix-product FLOPs of step(), recomputation included (core/methods/flop_model.h).
  virtual double flops(const Workload& workload) const = 0;
  // The same FLOPs by the phases that compute them, summing to flops(); empty for a method that does not split them.
  virtual std::vector<PhaseFlops> phase_flops(const Workload& /*workload*/) const { return {}; }

 protected:
  // The method itself: forward + backward of the prepared objective on `batch`, adding the gradients into grad()
  // (autograd's accumulation, ChunkGradients::commit); returns the loss. Phases go to `clock`.
  virtual double backprop(Model& model, const PreparedObjective& objective, const Batch& batch, PhaseClock& clock) = 0;
  // The events, for backprop: each method fires them where that group's gradient becomes final.
  void layer_ready(const Model& model, int layer) const;
  void head_ready(const Model& model) const;
  void embedding_ready(const Model& model) const;
  // While alive, decoder layer `layer`'s trainable tensors are in use (the parameter-use events' begin and end); its
  // start and end are also the layer's marks for the phase listener (mark_layer).
  class LayerInUse {
   public:
    LayerInUse(const BackpropMethod& method, const Model& model, int layer);
    ~LayerInUse();
    LayerInUse(const LayerInUse&) = delete;
    LayerInUse& operator=(const LayerInUse&) = delete;

   private:
    const BackpropMethod& method_;
    int layer_;
    ParameterUse use_;
  };
  bool tracks_parameter_use() const { return !parameter_use_.empty(); }
  OffloadTier* checkpoint_tier() const { return checkpoint_tier_; }
  // The forward of a method that keeps layer checkpoints, without a graph: H[0] the embedding of the batch, H[l + 1] =
  // layer(l, H[l]) while layer l's parameters are in use, each H[l] handed to the offload tier (if any) once read.
  // Returns the L + 1 checkpoints for the backward to take.
  LayerCheckpoints checkpointed_forward(const Model& model, const Batch& batch, PhaseClock& clock,
                                        const std::function<at::Tensor(int layer, const at::Tensor& h)>& layer) const;
  // The tokens this process back-propagates: the batch's, or on a sequence-parallel rank its shard's positions of
  // every row ([B, t]). The batch stays whole on every rank: the objective is prepared on the whole sequence, so its
  // targets are shifted before any split and its normalisers count every rank's tokens.
  static at::Tensor rank_tokens(const Model& model, const Batch& batch);
  // The objective's term for logits of rank_tokens' positions ([B, t, V]): one chunk at 0, or block by block at each
  // block's global start.
  // An objective with a row term (DPO, GRPO's sequence importance) first sums its statistics over the group.
  static at::Tensor rank_loss(const Model& model, const PreparedObjective& objective, const at::Tensor& logits);
  // The begin and end events of a layer, for a method whose uses are not one scope (standard BP: its backward runs
  // inside autograd).
  void layer_use(const Model& model, int layer, bool begin) const;

 private:
  void gradient_ready(std::string name, std::vector<at::Tensor> tensors) const;
  void parameter_use(ParameterUse use) const;
  EventHooks<GradientGroup> gradient_ready_;
  EventHooks<ParameterUse> parameter_use_;
  OffloadTier* checkpoint_tier_ = nullptr;
};

}  // namespace sbp
