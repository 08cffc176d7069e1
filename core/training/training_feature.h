// A feature of a training step (ARCHITECTURE.md §11): data parallelism (DDP, ZeRO 1-3), gradient or parameter offload,
// sequence parallelism. Trainer::step calls each active feature at the same points of every step, in the order they
// were made, and branches on none: a feature attaches to the method's events (subscriptions), never to a method's
// inside. Defaults do nothing, so a feature overrides only the points it acts at.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/io/safetensors.h"
#include "core/methods/event_hooks.h"
#include "core/methods/workload.h"
#include "core/objectives/objective.h"

namespace sbp {

class BackpropMethod;
class Communicator;
class DataParallel;
class Model;
class OffloadTier;
struct Batch;
struct TrainOptions;

class TrainingFeature {
 public:
  virtual ~TrainingFeature() = default;
  virtual std::string name() const = 0;

  // What the optimizer updates, from what the features before made of the model's trainable tensors (ZeRO's slices,
  // the parameter homes). Called once, when the trainer is made.
  virtual TensorList optimizer_params(TensorList params) { return params; }
  // The step's totals, from what the features before made of this rank's (counted once per group, summed over ranks).
  virtual void count_totals(StepTotals&) {}
  // Before the first micro-batch: what the feature holds while they run (its subscriptions to the method's events, a
  // K/V source), released after the last one, also when a micro-batch throws.
  virtual std::vector<Subscription> begin_micro_batches(const Batch&, const std::string& /*source*/) { return {}; }
  // Before the last micro-batch: its subscriptions to the gradient-ready events (a group's gradient is final there).
  virtual std::vector<Subscription> begin_last_micro_batch() { return {}; }
  // The step's loss, from this rank's.
  virtual double step_loss(double loss) { return loss; }
  // Before the clipping and the update, and after them.
  virtual void before_update() {}
  virtual void after_update() {}
  // Clips the gradients of the optimizer's params and returns their norm before clipping, when the feature computes it
  // (over ranks); nothing: the trainer's clip_grad_norm over this rank's params.
  virtual std::optional<double> clip_grad_norm(const TensorList& /*optimizer_params*/, double /*max_norm*/) {
    return std::nullopt;
  }

  // Outside a step (Trainer::WholeModel): every trainable tensor whole on the device (`begin`), or back where it lives
  // (`keep`: the values written meanwhile become the kept ones).
  virtual void whole_model(bool /*begin*/, bool /*keep*/) {}
  // Checkpoints: the optimizer's state as whole tensors (a file the same whatever the world size), and back.
  virtual TensorList whole_state(TensorList state) { return state; }
  virtual TensorList sliced_state(TensorList whole) { return whole; }
  // Whether this process writes the checkpoint files (one rank does; the others take part in gathering them).
  virtual bool writes_checkpoints() const { return true; }
  // Bytes it holds on the device between steps beside the model's tensors and the optimizer's states.
  virtual std::int64_t held_bytes() const { return 0; }
  // Its part of the workload of a training step, for the memory models.
  virtual void describe(Workload&) const {}
};

using TrainingFeatures = std::vector<std::unique_ptr<TrainingFeature>>;

// The features a trainer's options and DataParallel ask for, in the order a step calls them: sequence parallelism
// (its totals counted once per group before data parallelism sums them over ranks), data parallelism (with the
// gradient tier: what a rank keeps after the reduction moves there), one process's parameter offload, one process's
// gradient offload. Throws InputError for a combination that cannot run (parameter offload of TrainOptions on ranks,
// sequence parallelism without DataParallel or with a method that does not run on a shard).
TrainingFeatures make_training_features(Model& model, BackpropMethod& method, const TrainOptions& options,
                                        DataParallel* parallel);
}  // namespace sbp
