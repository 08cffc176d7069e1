// Data parallelism over a Communicator (ARCHITECTURE.md §12), ZeRO stages 0-3. Each rank back-propagates its rows of the
// global batch; the paper's rule: a gradient group (the head, a layer, the embedding) is reduced over ranks once, at
// its gradient-ready event of the step's last micro-batch (StreamBP: after the layer's chunk loop has committed its
// sums), never per chunk, so StreamBP communicates exactly what standard BP does. The objective is normalised by the
// global batch's totals (summed over ranks), so the SUM over ranks is the whole batch's gradient: never an average
// of per-rank means, which is wrong whenever ranks hold different numbers of target tokens.
//
// Stages (ZeRO paper): 0 = DDP, every rank all-reduces every group and updates every tensor; 1 = the optimizer's
// states are sharded: rank r owns the r-th of N contiguous slices of every trainable tensor's elements (so shard
// boundaries fall inside tensors), updates only those and all-gathers each group's updated slices afterwards;
// 2 = + the gradients: at the event a group is reduce-scattered straight into its owners' slices and the full-size
// gradients are freed. The gradient-norm for clipping is then summed over ranks. 3 = + the parameters: a rank keeps
// only its slices (what the optimizer updates); a group's full tensors exist only while a method uses them (the
// parameter-use events: a layer's forward, its backward chunk loop; the embedding and head for a whole step),
// all-gathered at the first begin and freed at the last end. Freeing swaps the tensor's data for an empty one
// (set_data, as DeepSpeed does): the same tensor objects, so the model and autograd's saved references see the
// gathered data again when it returns.
#pragma once

#include <map>
#include <vector>

#include "core/io/safetensors.h"
#include "core/methods/method.h"
#include "core/objectives/objective.h"
#include "core/training/communicator.h"

namespace sbp {

class OffloadTier;

class DataParallel {
 public:
  // `parameter_tier` (ZeRO-3 only): this rank's parameter slices live in that offload tier, the update runs on them
  // there, and a use's all-gather reads them from it (parameter offload).
  DataParallel(Communicator& communicator, int zero_stage = 0, OffloadTier* parameter_tier = nullptr);
  virtual ~DataParallel() = default;
  Communicator& communicator() const { return communicator_; }
  int zero_stage() const { return stage_; }

  // What the optimizer updates: the trainable tensors (stage 0), or this rank's slice of each, under the tensor's
  // name: a flat view into the tensor, so that an update lands in the model (stages 1-2).
  TensorList optimizer_params(const TensorList& trainable);

  // Stage 3: a parameter-use event (BackpropMethod::on_parameter_use): the first begin of a tensor gathers it (one
  // all-gather for the event's tensors that are not present), the matching last end frees it. Other stages: nothing.
  void use(const ParameterUse& use);
  // Stage 3: while alive, every trainable tensor is present in full (a pass outside a step: the log-probs of the
  // current policy, saving the model).
  class WholeModel {
   public:
    WholeModel(DataParallel& parallel, const TensorList& trainable);
    ~WholeModel();
    WholeModel(const WholeModel&) = delete;
    WholeModel& operator=(const WholeModel&) = delete;

   private:
    DataParallel& parallel_;
    ParameterUse use_;
  };

  // Checkpoints that do not depend on the world size (stages 1-3; every rank takes part): the optimizer's state
  // (Optimizer::state of this rank's slices) as whole tensors, each all-gathered; and back, this rank's slices of a
  // whole state (views). Entries that are not a tensor's slice (the step counts) pass through.
  TensorList whole_state(const TensorList& state);
  TensorList sliced_state(const TensorList& whole);
  // Stage 3, after whole tensors were written into the trainable tensors (inside a WholeModel): this rank's slices
  // take their values (stages 1-2: the slices are views already).
  void keep_slices();
  // Stage 3: every tensor whole again and no longer sharded (every rank takes part); for a driver that measures
  // with a fresh DataParallel per probe on one model. Other stages: nothing.
  void unshard();
  // Stage 3: the bytes of this rank's parameter slices held on the device between steps (the model's tensors then hold
  // none; with a parameter tier, neither do they).
  std::int64_t sliced_parameter_bytes() const;

  // The step's totals over every rank's micro-batches (one all-reduce).
  virtual StepTotals global_totals(const StepTotals& local);
  // At a group's gradient-ready event: stages 0-1 sum its gradients over the ranks in place, as one flat all-reduce;
  // stage 2 reduce-scatters them into the owners' slices and frees the full gradients. A gradient a rank lacks
  // counts as zeros. With `tier`, what the rank keeps (the full gradients, or its slices) then moves there.
  virtual void reduce(const GradientGroup& group, OffloadTier* tier = nullptr);
  // The step's loss over ranks (each rank's share is already normalised by the global totals).
  double global_loss(double local);

  // Between the BP and the update: the slices' gradients in place (stage 1: views of the reduced full gradients),
  // then torch's clip_grad_norm_ over the gradients of every rank's optimizer params (the norm summed over ranks
  // when they are sharded); returns the norm before clipping.
  double clip_grad_norm(const TensorList& optimizer_params, double max_norm);
  // After the update (stages 1-2): every group's updated slices all-gathered into the full tensors (stage 3: the
  // slices are the parameters; the next use gathers them).
  void gather_updated();

 private:
  struct Slice {
    std::int64_t start = 0, end = 0, padded = 0;  // this rank's [start, end) of the flat tensor; every rank's length
  };
  Slice slice_of(std::int64_t numel, int rank) const;
  std::vector<std::int64_t> full_sizes(const at::Tensor& p) const;  // stage 3: also while its data is freed
  std::vector<at::Tensor> group_gradients(const GradientGroup& group) const;
  // The totals', loss's and norm's small tensors live where the communicator's collectives take them (the CPU for
  // Gloo, the rank's GPU for NCCL); the gradients already do, as the model does.
  at::TensorOptions on_device(at::ScalarType dtype) const;
  // Per group: its tensors, in event order (the layout of its flat buffers).
  std::vector<std::pair<std::string, std::vector<at::Tensor>>> groups_;

  Communicator& communicator_;
  int stage_;
  OffloadTier* parameter_tier_;
  std::map<const void*, at::Tensor> shard_grads_;  // stage 2: by the tensor's impl, this rank's reduced slice
  std::map<const void*, at::Tensor> shards_;       // stages 1-2: the optimizer's view of each tensor's slice
                                                   // stage 3: the slice itself (the tensor's data is empty when unused)
  struct Residence {
    std::vector<std::int64_t> sizes;  // the full tensor's
    int users = 0;                    // open uses (nested begins)
  };
  std::map<const void*, Residence> residence_;  // stage 3
  std::map<std::string, at::Tensor> by_name_;   // stages 1-3: the sliced tensors by name
  const at::Tensor* sliced_tensor_of(const std::string& state_name) const;  // "<tensor name>.<state>"
};

}  // namespace sbp
