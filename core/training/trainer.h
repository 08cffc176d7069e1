// Training (ARCHITECTURE.md §11): optimizer steps of any BP method. One step = the micro-batches of one global batch, each
// back-propagated by the method into the same gradients, normalised by the whole step's totals (so K micro-batches
// of B equal one batch of K*B), then torch's clip_grad_norm_, the schedule's learning rate and the optimizer update.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "core/objectives/batch.h"
#include "core/training/lr_schedule.h"
#include "core/methods/method.h"
#include "core/training/optimizer.h"
#include "core/training/training_feature.h"
#include "core/training/sequence_scheme.h"
#include "core/io/input_error.h"

namespace sbp {

class Communicator;
class Model;
class DataParallel;
class OffloadTier;

struct TrainOptions {
  OptimizerOptions optimizer;
  LrSchedule schedule;
  std::int64_t total_steps = 1;  // of the whole run (the schedule's horizon), resumed or not
  std::int64_t grad_accum = 1;   // micro-batches per step, of equal size
  // Set: the step's micro-batches by rows of its batch instead (Objective::micro_batches; uneven ones allowed), as a
  // conformance case's step gives them. grad_accum is then 1.
  MicroBatchRows micro_batch_rows;
  double clip_grad_norm = 0;     // 0: no clipping (the norm is still reported)
  // The optimizer's states in this offload tier, the update where they are (null: on the device). Outlives the trainer.
  OffloadTier* optimizer_tier = nullptr;
  // The gradients moved into this offload tier at their groups' gradient-ready events of the step's last micro-batch
  // (after the data-parallel reduction: what this rank keeps), read there by the clipping and the update (null: on the
  // device). Outlives the trainer.
  OffloadTier* gradient_tier = nullptr;
  // One process (no DataParallel): the trainable tensors live in this offload tier between their uses
  // (ParameterHome), the update runs on them there. Data-parallel, the tier goes to DataParallel (ZeRO-3's slices).
  OffloadTier* parameter_tier = nullptr;
  // Sequence parallelism (ARCHITECTURE.md §16): every sequence of this rank's rows is split over this group (its ranks
  // hold the same rows), the model attending this rank's zig-zag shard; null: whole sequences. Needs a DataParallel
  // over every rank (the gradients are summed over all of them). Outlives the trainer.
  Communicator* sequence_group = nullptr;
  SequenceScheme sequence_scheme = SequenceScheme::allgather;  // how the group exchanges K/V (--sp-scheme)
};

struct TrainStepResult {
  std::int64_t step = 0;  // 1-based: the number of optimizer steps taken after this one
  double loss = 0;        // the step's objective (the sum of its micro-batches' terms, over every rank)
  double grad_norm = 0;   // global 2-norm of the gradients before clipping (clip_grad_norm_'s return value)
  double lr = 0;          // the learning rate this step used
  std::int64_t tokens = 0;  // scored target tokens of the step (of the global batch)
  double bp_seconds = 0, optimizer_seconds = 0;  // forward + backward of all micro-batches; clipping + update
};

// The optimizer's states and its update's temporaries for this model's trainable tensors (optimizer_memory), into
// the workload of a training step, for training_memory: this rank's slices' at ZeRO stage >= 1 (the workload's
// DataParallelism, optimizer_shard).
void add_optimizer_memory(Workload& workload, const Model& model, const OptimizerOptions& options);

class Trainer {
 public:
  // The model's trainable tensors (Model::trainable: all weights, or the LoRA adapters) are what the optimizer
  // updates. References are kept: model, method and objective outlive the trainer.
  // With `parallel`, this rank's batches are its rows of the global batch and every step is data-parallel (the
  // gradients summed over ranks at their gradient-ready events, the objective normalised by the global totals).
  Trainer(Model& model, BackpropMethod& method, const Objective& objective, TrainOptions options,
          DataParallel* parallel = nullptr);
  ~Trainer();  // with parameter offload: the model's tensors whole on the device again
  Trainer(Trainer&&);

  // While alive, every trainable tensor is whole on the device: ZeRO-3's slices gathered (every rank takes part), one
  // process's offloaded parameters fetched (a pass outside a step: reference log-probs, saving the model). With
  // `keep`, values written into the model's tensors meanwhile become the kept ones (slices, homes) at its end.
  class WholeModel {
   public:
    explicit WholeModel(const Trainer& trainer, bool keep = false);
    ~WholeModel();
    WholeModel(const WholeModel&) = delete;
    WholeModel& operator=(const WholeModel&) = delete;

   private:
    const Trainer& trainer_;
    bool keep_;
  };

  // The micro-batches of a step on `batch` (options' micro_batch_rows, else grad_accum equal ones).
  std::vector<Batch> micro_batches(const Batch& batch, const std::string& source) const;
  // One optimizer step on a global batch (prepared log-probs included, see complete_batch): split into
  // options.grad_accum micro-batches (Objective::split), each back-propagated with the step's totals.
  TrainStepResult step(const Batch& batch, const std::string& source = "batch");

  std::int64_t steps_taken() const { return optimizer_.steps_taken(); }
  const TrainOptions& options() const { return options_; }
  const Optimizer& optimizer() const { return optimizer_; }

  // The one place a training step's workload learns how it is distributed: each feature's description (the
  // DataParallelism of this trainer's DataParallel: world size, ZeRO stage, the backend's collective copies), and the
  // optimizer's bytes of what it updates (this rank's slices under ZeRO 1-3, the homes under parameter offload).
  // Updating the model's own tensors: add_optimizer_memory of this trainer's model and optimizer.
  void add_optimizer_memory(Workload& workload) const;
  Model& model() const { return model_; }
  // What the trainer holds on the device between steps beside the model's tensors: the optimizer's states (none in an
  // offload tier) and, under ZeRO-3, this rank's parameter slices (a measured peak counts them as it counts the
  // weights).
  std::int64_t held_bytes() const;

  // Resumable checkpoints: DIR/checkpoint-NNNNNN/ holding the trainable tensors (trainable.safetensors, their own
  // dtypes), the optimizer state (optimizer.safetensors: states, per-tensor and global step counts) and
  // trainer.json (step, specs, `run`: what the caller needs to check and continue, e.g. its arguments and data
  // position). Written into a temporary directory and renamed: a reader sees a whole checkpoint or none.
  // Data-parallel: every rank calls it; ZeRO's slices are gathered into whole tensors (the same files whatever the
  // world size and stage) and rank 0 writes them (the other ranks return an empty path).
  std::filesystem::path save_checkpoint(const std::filesystem::path& dir, const nlohmann::json& run) const;
  // Loads a checkpoint written by save_checkpoint for the same model, method-independent; returns its `run`.
  // Throws InputError naming the file and tensor on any mismatch.
  nlohmann::json load_checkpoint(const std::filesystem::path& checkpoint);
  // The complete checkpoint of DIR with the most steps, or empty when there is none.
  static std::filesystem::path latest_checkpoint(const std::filesystem::path& dir);

 private:
  // The gradients of optimizer_params_ clipped to max_norm (over ranks when a feature computes the norm); the norm
  // before clipping.
  double clip_gradients(double max_norm);

  Model& model_;
  BackpropMethod& method_;
  const Objective& objective_;
  TrainOptions options_;
  // What the options and the DataParallel ask for (make_training_features), in the order a step calls them.
  TrainingFeatures features_;
  // The trainable tensors, (ZeRO 1-3) this rank's slices of them, or their homes: what the features made of them.
  TensorList optimizer_params_;
  Optimizer optimizer_;
};

}  // namespace sbp
