// The features of a training step (training_feature.h): each one's work at the points Trainer::step calls.
#include "core/training/training_feature.h"

#include <memory>
#include <optional>

#include "core/io/input_error.h"
#include "core/methods/method.h"
#include "core/model/model.h"
#include "core/offload/offload_tier.h"
#include "core/training/data_parallel.h"
#include "core/training/parameter_home.h"
#include "core/training/sequence_parallel.h"
#include "core/training/trainer.h"

namespace sbp {
namespace {

// Sequence parallelism (ARCHITECTURE.md §16): every sequence of this rank's rows split over `group` (its ranks hold
// the same rows), the model attending this rank's zig-zag shard while the micro-batches run.
class SequenceParallelFeature final : public TrainingFeature {
 public:
  SequenceParallelFeature(Model& model, Communicator& group, SequenceScheme scheme)
      : model_(model), group_(group), scheme_(scheme) {}
  std::string name() const override { return "sequence parallelism"; }
  // The ranks of a group hold the same rows: their totals count once, by the group's rank 0.
  void count_totals(StepTotals& totals) override {
    if (group_.rank() != 0) totals = {};
  }
  // The group's ranks must split the same sequences: their T is compared first (once per step), so that a rank
  // handed another batch fails naming it instead of waiting in a collective of another shape.
  std::vector<Subscription> begin_micro_batches(const Batch& batch, const std::string& source) override {
    const auto T = batch.input_ids.size(1);
    if (const auto d = first_disagreement(group_, {T}))
      throw InputError(source + ": rank " + std::to_string(d->rank) + " of the sequence-parallel group " +
                       "holds sequences of " + std::to_string(d->theirs) + " positions and rank 0 of " +
                       std::to_string(d->rank0) + " (sequence length): the ranks of a group split the " +
                       "same sequences");
    exchange_ = make_sequence_exchange(scheme_, group_, T);
    model_.set_kv_source(exchange_.get());
    std::vector<Subscription> held;
    held.emplace_back([this] {
      model_.set_kv_source(nullptr);
      exchange_.reset();
    });
    return held;
  }
  void describe(Workload& w) const override { w.add(SequenceParallelism{group_.world_size(), scheme_}); }

 private:
  Model& model_;
  Communicator& group_;
  SequenceScheme scheme_;
  std::unique_ptr<KVSource> exchange_;
};

// Data parallelism (ARCHITECTURE.md §12), DDP or ZeRO 1-3 over DataParallel; with a gradient tier, what this rank keeps
// of each group after its reduction moves there.
class DataParallelFeature final : public TrainingFeature {
 public:
  DataParallelFeature(BackpropMethod& method, const Model& model, DataParallel& parallel, OffloadTier* gradient_tier)
      : method_(method), model_(model), parallel_(parallel), gradient_tier_(gradient_tier) {}
  std::string name() const override { return "data parallelism"; }
  TensorList optimizer_params(TensorList params) override { return parallel_.optimizer_params(params); }
  void count_totals(StepTotals& totals) override { totals = parallel_.global_totals(totals); }
  // ZeRO-3: the method's parameter uses gather and free the sharded parameters (other stages: nothing to do).
  std::vector<Subscription> begin_micro_batches(const Batch&, const std::string&) override {
    std::vector<Subscription> held;
    held.push_back(method_.on_parameter_use([this](const ParameterUse& use) { parallel_.use(use); }));
    return held;
  }
  // Each group is reduced over ranks when its gradient is final for the step: at its event of the last micro-batch.
  std::vector<Subscription> begin_last_micro_batch() override {
    std::vector<Subscription> held;
    held.push_back(method_.on_gradient_ready(
        [this](const GradientGroup& group) { parallel_.reduce(group, gradient_tier_); }));
    return held;
  }
  double step_loss(double loss) override { return parallel_.global_loss(loss); }
  std::optional<double> clip_grad_norm(const TensorList& params, double max_norm) override {
    return parallel_.clip_grad_norm(params, max_norm);
  }
  void after_update() override { parallel_.gather_updated(); }  // ZeRO 1-2: the updated slices into the full tensors
  void whole_model(bool begin, bool keep) override {
    if (parallel_.zero_stage() != 3) return;
    if (!begin && keep) parallel_.keep_slices();
    ParameterUse use{"model", {}, begin};
    for (const auto& p : model_.trainable()) use.tensors.push_back(p.tensor);
    parallel_.use(use);
  }
  // ZeRO: the ranks' slices assembled into whole tensors (every rank takes part), so that a checkpoint is the same
  // file whatever the world size and stage, and resumes on any.
  TensorList whole_state(TensorList state) override {
    return parallel_.zero_stage() > 0 ? parallel_.whole_state(state) : state;
  }
  TensorList sliced_state(TensorList whole) override {
    return parallel_.zero_stage() > 0 ? parallel_.sliced_state(whole) : whole;
  }
  bool writes_checkpoints() const override { return parallel_.communicator().rank() == 0; }
  std::int64_t held_bytes() const override { return parallel_.sliced_parameter_bytes(); }
  void describe(Workload& w) const override {
    w.add(DataParallelism{.world_size = parallel_.communicator().world_size(),
                          .zero_stage = parallel_.zero_stage(),
                          .collective_copies = parallel_.communicator().copies_collective_buffers()});
  }

 private:
  BackpropMethod& method_;
  const Model& model_;
  DataParallel& parallel_;
  OffloadTier* gradient_tier_;
};

// One process's parameter offload (ParameterHome): the trainable tensors in the tier between their uses, fetched and
// dropped at the method's parameter-use events; the homes are what is clipped and updated.
class ParameterOffloadFeature final : public TrainingFeature {
 public:
  ParameterOffloadFeature(BackpropMethod& method, const Model& model, OffloadTier& tier)
      : method_(method), home_(model.trainable(), tier) {}
  std::string name() const override { return "parameter offload"; }
  TensorList optimizer_params(TensorList) override { return home_.optimizer_params(); }
  std::vector<Subscription> begin_micro_batches(const Batch&, const std::string&) override {
    std::vector<Subscription> held;
    held.push_back(method_.on_parameter_use([this](const ParameterUse& use) { home_.use(use); }));
    return held;
  }
  void before_update() override { home_.attach_gradients(); }
  void after_update() override { home_.detach_gradients(); }
  void whole_model(bool begin, bool keep) override {
    if (!begin && keep) home_.keep();
    home_.use(home_.whole(begin));
  }

 private:
  BackpropMethod& method_;
  ParameterHome home_;
};

// One process's gradient offload: each group's gradients move into the tier at its event of the step's last
// micro-batch; before then the method still adds into them (the earlier micro-batches' stay on the device, so that
// every sum is the one of a run without offload).
class GradientOffloadFeature final : public TrainingFeature {
 public:
  GradientOffloadFeature(BackpropMethod& method, OffloadTier& tier) : method_(method), tier_(tier) {}
  std::string name() const override { return "gradient offload"; }
  std::vector<Subscription> begin_last_micro_batch() override {
    std::vector<Subscription> held;
    held.push_back(method_.on_gradient_ready([this](const GradientGroup& group) { store_gradients(tier_, group.tensors); }));
    return held;
  }

 private:
  BackpropMethod& method_;
  OffloadTier& tier_;
};

}  // namespace

TrainingFeatures make_training_features(Model& model, BackpropMethod& method, const TrainOptions& options,
                                        DataParallel* parallel) {
  TrainingFeatures out;
  if (options.parameter_tier && parallel)
    throw InputError("parameter offload on ranks: the tier goes to DataParallel (ZeRO-3's slices), not to "
                     "TrainOptions::parameter_tier");
  if (options.sequence_group) {
    if (!parallel)
      throw InputError("sequence parallelism needs a DataParallel over every rank: each rank's gradient is "
                       "its shard's share, summed over all ranks");
    if (!method.runs_sequence_shards())
      throw InputError("method " + method.spec() + " does not run on a sequence-parallel rank's shard "
                       "(standard BP, checkpointing and StreamBP do)");
    out.push_back(std::make_unique<SequenceParallelFeature>(model, *options.sequence_group, options.sequence_scheme));
  }
  if (parallel) out.push_back(std::make_unique<DataParallelFeature>(method, model, *parallel, options.gradient_tier));
  if (options.parameter_tier) out.push_back(std::make_unique<ParameterOffloadFeature>(method, model, *options.parameter_tier));
  if (options.gradient_tier && !parallel)
    out.push_back(std::make_unique<GradientOffloadFeature>(method, *options.gradient_tier));
  return out;
}

}  // namespace sbp
