#include "core/training/trainer.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <fstream>
#include <limits>
#include <optional>
#include <stdexcept>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include "core/model/model.h"
#include "core/model/gemm.h"
#include "core/methods/memory_model.h"
#include "core/training/training_memory.h"
#include "core/training/optimizer_shard.h"
#include "core/training/data_parallel.h"
#include "core/training/parameter_home.h"
#include "core/training/sequence_parallel.h"
#include "core/objectives/objective.h"
#include "core/io/safetensors.h"
#include "core/offload/offload_tier.h"
#include "core/io/input_error.h"

namespace sbp {

namespace fs = std::filesystem;

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The objective normalises by the step's totals for the duration of a scope, and by each batch's own after it.
class StepTotalsScope {
 public:
  StepTotalsScope(Objective& objective, const StepTotals& totals) : objective_(objective) {
    objective_.set_step_totals(totals);
  }
  ~StepTotalsScope() { objective_.set_step_totals(std::nullopt); }
  StepTotalsScope(const StepTotalsScope&) = delete;
  StepTotalsScope& operator=(const StepTotalsScope&) = delete;

 private:
  Objective& objective_;
};

// The method calls back into the trainer for the duration of a scope only (also when its step throws).
class MethodEvents {
 public:
  explicit MethodEvents(BackpropMethod& method) : method_(method) {}
  ~MethodEvents() {
    method_.on_gradient_ready(nullptr);
    method_.on_parameter_use(nullptr);
  }
  MethodEvents(const MethodEvents&) = delete;
  MethodEvents& operator=(const MethodEvents&) = delete;

 private:
  BackpropMethod& method_;
};

// While alive, the model attends this rank's shard of sequences of T positions split over `group` (null: whole
// sequences). The group's ranks must split the same sequences: their T is compared first (once per step), so that a
// rank handed another batch fails naming it instead of waiting in a collective of another shape.
class SequenceScope {
 public:
  SequenceScope(Model& model, Communicator* group, SequenceScheme scheme, std::int64_t T, const std::string& source)
      : model_(model) {
    if (!group) return;
    if (const auto d = first_disagreement(*group, {T}))
      throw InputError(source + ": rank " + std::to_string(d->rank) + " of the sequence-parallel group " +
                                  "holds sequences of " + std::to_string(d->theirs) + " positions and rank 0 of " +
                                  std::to_string(d->rank0) + " (sequence length): the ranks of a group split the " +
                                  "same sequences");
    exchange_ = make_sequence_exchange(scheme, *group, T);
    model_.set_kv_source(exchange_.get());
  }
  ~SequenceScope() {
    if (exchange_) model_.set_kv_source(nullptr);
  }
  SequenceScope(const SequenceScope&) = delete;
  SequenceScope& operator=(const SequenceScope&) = delete;

 private:
  Model& model_;
  std::unique_ptr<KVSource> exchange_;
};

constexpr const char* kCheckpointPrefix = "checkpoint-";

std::string checkpoint_name(std::int64_t step) {
  auto digits = std::to_string(step);
  return kCheckpointPrefix + std::string(digits.size() < 6 ? 6 - digits.size() : 0, '0') + digits;
}

}  // namespace

namespace {

std::unique_ptr<ParameterHome> make_home(const Model& model, const TrainOptions& options, const DataParallel* parallel) {
  if (!options.parameter_tier) return nullptr;
  if (parallel)
    throw InputError("parameter offload on ranks: the tier goes to DataParallel (ZeRO-3's slices), not to "
                                "TrainOptions::parameter_tier");
  return std::make_unique<ParameterHome>(model.trainable(), *options.parameter_tier);
}

}  // namespace

Trainer::Trainer(Model& model, BackpropMethod& method, Objective& objective, TrainOptions options,
                 DataParallel* parallel)
    : model_(model), method_(method), objective_(objective), options_(std::move(options)), parallel_(parallel),
      home_(make_home(model, options_, parallel)),
      optimizer_params_(parallel ? parallel->optimizer_params(model.trainable())
                        : home_  ? home_->optimizer_params()
                                 : model.trainable()),
      optimizer_(optimizer_params_, options_.optimizer, options_.optimizer_tier) {
  if (options_.grad_accum < 1) throw InputError("--grad-accum must be >= 1");
  if (!options_.micro_batch_rows.empty() && options_.grad_accum != 1)
    throw InputError("--micro-batches gives the step's micro-batches: --grad-accum is then 1");
  if (options_.total_steps < 1) throw InputError("--steps must be >= 1");
  if (!(options_.clip_grad_norm >= 0)) throw InputError("--clip-grad-norm must be >= 0");
  if (options_.sequence_group && !parallel_)
    throw InputError("sequence parallelism needs a DataParallel over every rank: each rank's gradient is "
                                "its shard's share, summed over all ranks");
  if (options_.sequence_group && !method_.runs_sequence_shards())
    throw InputError("method " + method_.spec() + " does not run on a sequence-parallel rank's shard "
                                "(standard BP, checkpointing and StreamBP do)");
}

std::vector<Batch> Trainer::micro_batches(const Batch& batch, const std::string& source) const {
  return options_.micro_batch_rows.empty() ? objective_.split(batch, options_.grad_accum, source)
                                           : objective_.micro_batches(batch, options_.micro_batch_rows,
                                                                      source + ", --micro-batches");
}

TrainStepResult Trainer::step(const Batch& batch, const std::string& source) {
  TrainStepResult out;
  const auto micro = micro_batches(batch, source);
  // The step's totals: every micro-batch prepared once (its checks run before any gradient exists).
  StepTotals totals;
  for (const auto& m : micro) {
    objective_.prepare(m, model_.config(), source);
    const auto t = objective_.batch_totals();
    totals.rows += t.rows;
    totals.tokens += t.tokens;
  }
  // The ranks of a sequence-parallel group hold the same rows: their totals count once, by the group's rank 0.
  if (options_.sequence_group && options_.sequence_group->rank() != 0) totals = {};
  if (parallel_) totals = parallel_->global_totals(totals);
  out.tokens = totals.tokens;
  {
    const SequenceScope sequence(model_, options_.sequence_group, options_.sequence_scheme,
                                 batch.input_ids.size(1), source);
    const StepTotalsScope scope(objective_, totals);
    const MethodEvents events(method_);
    // ZeRO-3: the method's parameter uses gather and free the sharded parameters; one process's offloaded parameters
    // are fetched and dropped at the same events.
    if (parallel_) method_.on_parameter_use([this](const ParameterUse& use) { parallel_->use(use); });
    if (home_) method_.on_parameter_use([this](const ParameterUse& use) { home_->use(use); });
    for (std::size_t k = 0; k < micro.size(); ++k) {
      // Data-parallel: each group is reduced over ranks when its gradient is final for the step, i.e. at its event
      // of the last micro-batch.
      // Gradient offload at the same events: before them the method still adds into the gradients (the earlier
      // micro-batches' stay on the device, so that every sum is the one of a run without offload).
      if (k + 1 == micro.size() && (parallel_ || options_.gradient_tier))
        method_.on_gradient_ready([this](const GradientGroup& group) {
          if (parallel_)
            parallel_->reduce(group, options_.gradient_tier);
          else
            store_gradients(*options_.gradient_tier, group.tensors);
        });
      const auto r = method_.step(model_, objective_, micro[k], {.accumulate = k > 0});
      out.loss += r.loss;
      out.bp_seconds += r.bp_seconds;
    }
  }
  if (parallel_) out.loss = parallel_->global_loss(out.loss);
  const auto start = std::chrono::steady_clock::now();
  // Without clipping the norm is still reported: a coefficient of exactly 1 leaves every gradient bit as it was.
  const double max_norm =
      options_.clip_grad_norm > 0 ? options_.clip_grad_norm : std::numeric_limits<double>::infinity();
  if (home_) home_->attach_gradients();  // the homes are what is clipped and updated
  if (parallel_) {
    out.grad_norm = parallel_->clip_grad_norm(optimizer_params_, max_norm);
  } else {
    std::vector<at::Tensor> params;
    for (const auto& p : optimizer_params_) params.push_back(p.tensor);
    out.grad_norm = clip_grad_norm(params, max_norm);
  }
  out.lr = lr_at(options_.schedule, options_.optimizer.lr, optimizer_.steps_taken(), options_.total_steps);
  optimizer_.step(out.lr);
  if (parallel_) parallel_->gather_updated();  // ZeRO 1-2: every rank's updated slices into the full tensors
  if (home_) home_->detach_gradients();
  synchronize(model_.device());
  out.optimizer_seconds = seconds_since(start);
  out.step = optimizer_.steps_taken();
  return out;
}

Trainer::~Trainer() = default;
Trainer::Trainer(Trainer&&) = default;

Trainer::WholeModel::WholeModel(const Trainer& trainer, bool keep) : trainer_(trainer), keep_(keep) {
  if (trainer_.parallel_ && trainer_.parallel_->zero_stage() == 3) {
    ParameterUse use{"model", {}, true};
    for (const auto& p : trainer_.model_.trainable()) use.tensors.push_back(p.tensor);
    trainer_.parallel_->use(use);
  }
  if (trainer_.home_) trainer_.home_->use(trainer_.home_->whole(true));
}

Trainer::WholeModel::~WholeModel() {
  if (trainer_.parallel_ && trainer_.parallel_->zero_stage() == 3) {
    if (keep_) trainer_.parallel_->keep_slices();
    ParameterUse use{"model", {}, false};
    for (const auto& p : trainer_.model_.trainable()) use.tensors.push_back(p.tensor);
    trainer_.parallel_->use(use);
  }
  if (trainer_.home_) {
    if (keep_) trainer_.home_->keep();
    trainer_.home_->use(trainer_.home_->whole(false));
  }
}

void Trainer::add_optimizer_memory(Workload& workload) const {
  if (home_) {  // the model's tensors are empty between uses: the homes' shapes
    std::vector<ParamShape> shapes;
    for (const auto& p : optimizer_params_) shapes.push_back({p.name, p.tensor.sizes().vec(), p.tensor.scalar_type()});
    const auto m = optimizer_memory(options_.optimizer, shapes);
    workload.optimizer_state_bytes = m.state_bytes;
    workload.optimizer_update_bytes = m.step_temporary_bytes;
    return;
  }
  if (!parallel_) return sbp::add_optimizer_memory(workload, model_, options_.optimizer);
  workload.world_size = parallel_->communicator().world_size();
  workload.zero_stage = parallel_->zero_stage();
  workload.collective_copies = parallel_->communicator().copies_collective_buffers();
  // What this rank's optimizer updates, exactly: the tensors (stage 0) or this rank's slices of them (ZeRO 1-3; at
  // stage 3 the model's own tensors are empty between uses).
  std::vector<ParamShape> shapes;
  for (const auto& p : optimizer_params_) shapes.push_back({p.name, p.tensor.sizes().vec(), p.tensor.scalar_type()});
  const auto m = optimizer_memory(options_.optimizer, shapes);
  workload.optimizer_state_bytes = m.state_bytes;
  workload.optimizer_update_bytes = m.step_temporary_bytes;
}

std::int64_t Trainer::held_bytes() const {
  return optimizer_.device_state_bytes() + (parallel_ ? parallel_->sliced_parameter_bytes() : 0);
}

void add_optimizer_memory(Workload& workload, const Model& model, const OptimizerOptions& options) {
  std::vector<ParamShape> shapes;
  for (const auto& p : model.trainable()) shapes.push_back({p.name, p.tensor.sizes().vec(), p.tensor.scalar_type()});
  const auto m = optimizer_memory(options, optimizer_shard(shapes, workload));
  workload.optimizer_state_bytes = m.state_bytes;
  workload.optimizer_update_bytes = m.step_temporary_bytes;
}

fs::path Trainer::save_checkpoint(const fs::path& dir, const nlohmann::json& run) const {
  // ZeRO: the ranks' slices assembled into whole tensors (every rank takes part), so that a checkpoint is the same
  // file whatever the world size and stage, and resumes on any.
  const bool sharded = parallel_ && parallel_->zero_stage() > 0;
  const WholeModel whole(*this);
  const auto state = sharded ? parallel_->whole_state(optimizer_.state()) : optimizer_.state();
  if (parallel_ && parallel_->communicator().rank() != 0) return {};
  fs::create_directories(dir);
  const auto final_dir = dir / checkpoint_name(steps_taken());
  // Same file system as the final name, so the rename is atomic; the pid keeps two writers apart.
  const auto tmp = dir / (".tmp-" + final_dir.filename().string() + "-" + std::to_string(::getpid()));
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  write_safetensors(tmp / "trainable.safetensors", model_.trainable());
  save_optimizer_state(optimizer_.options(), state, tmp / "optimizer.safetensors");
  nlohmann::json meta = {{"step", steps_taken()},
                               {"optimizer", optimizer_spec(optimizer_.options())},
                               {"lr_schedule", lr_schedule_spec(options_.schedule)},
                               {"total_steps", options_.total_steps},
                               {"grad_accum", options_.grad_accum},
                               {"clip_grad_norm", options_.clip_grad_norm},
                               {"run", run}};
  // The narrow-dtype GEMM paths of this run (core/model/gemm.h): a resumed run takes the same ones, so that it
  // continues bitwise whatever its own probe would choose on a busier or another machine.
  if (!gemm_paths_reason(model_.dtype()).empty()) meta["narrow_gemm"] = gemm_paths(model_.dtype()).describe();
  // trainer.json last: a directory with it is complete (and only such a directory is ever renamed into place).
  write_file_atomically(tmp / "trainer.json", meta.dump(2) + "\n");
  // A rerun of the same step replaces it: the old one is renamed away first (atomic), never deleted in place, so a
  // kill at any moment leaves whole checkpoints only (the `.tmp-`/`.old-` names are never picked).
  const auto old = dir / (".old-" + final_dir.filename().string() + "-" + std::to_string(::getpid()));
  if (fs::exists(final_dir)) fs::rename(final_dir, old);
  fs::rename(tmp, final_dir);
  fs::remove_all(old);
  return final_dir;
}

nlohmann::json Trainer::load_checkpoint(const fs::path& checkpoint) {
  // ZeRO-3 and parameter offload: the tensors whole while their values are checked and written, then kept as this
  // rank's slices or in their homes.
  const bool sharded = parallel_ && parallel_->zero_stage() > 0;
  std::optional<WholeModel> whole;
  whole.emplace(*this, /*keep=*/true);
  const auto meta_file = checkpoint / "trainer.json";
  if (!fs::exists(meta_file)) throw InputError(checkpoint.string() + ": not a training checkpoint (no trainer.json)");
  nlohmann::json meta;
  try {
    std::ifstream in(meta_file);
    meta = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(meta_file.string() + ": " + e.what());
  }
  // What is read below, checked here: nlohmann's own errors name no file (found by fuzz_train_resume).
  if (!meta.is_object() || !meta.contains("step") || !meta["step"].is_number_integer() || !meta.contains("run"))
    throw InputError(meta_file.string() + ": not a trainer.json of `train` (needs an integer \"step\" and "
                                "\"run\")");
  const auto tensors = read_safetensors(checkpoint / "trainable.safetensors");
  const auto& trainable = model_.trainable();
  const auto file = (checkpoint / "trainable.safetensors").string();
  if (tensors.size() != trainable.size())
    throw InputError(file + ": " + std::to_string(tensors.size()) + " tensors, the model trains " +
                                std::to_string(trainable.size()));
  // Everything is checked before anything is copied: source[i] is the file's tensor for trainable[i].
  std::vector<const at::Tensor*> source;
  for (const auto& p : trainable) {
    const auto it = std::find_if(tensors.begin(), tensors.end(), [&](const NamedTensor& t) { return t.name == p.name; });
    if (it == tensors.end()) throw InputError(file + ": tensor '" + p.name + "' missing");
    if (it->tensor.sizes() != p.tensor.sizes() || it->tensor.scalar_type() != p.tensor.scalar_type())
      throw InputError(file + ": tensor '" + p.name + "' is " + c10::str(it->tensor.sizes()) + " " +
                                  c10::toString(it->tensor.scalar_type()) + ", the model's is " +
                                  c10::str(p.tensor.sizes()) + " " + c10::toString(p.tensor.scalar_type()));
    source.push_back(&it->tensor);
  }
  const auto state_file = checkpoint / "optimizer.safetensors";
  const auto state = read_safetensors(state_file);
  optimizer_.load_state(sharded ? parallel_->sliced_state(state) : state, state_file.string());
  if (optimizer_.steps_taken() != meta.at("step").get<std::int64_t>())
    throw InputError(checkpoint.string() + ": optimizer.safetensors and trainer.json disagree on the step");
  if (meta.contains("narrow_gemm")) {
    if (!meta["narrow_gemm"].is_string())
      throw InputError(meta_file.string() + ": \"narrow_gemm\" is not a string like \"nt=native,nn=widened,tn=widened\"");
    pin_gemm_paths(model_.dtype(), meta["narrow_gemm"].get<std::string>(), meta_file.string());
  }
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < trainable.size(); ++i) trainable[i].tensor.copy_(*source[i]);
  whole.reset();  // the values kept (ZeRO-3's slices, the homes)
  return meta.at("run");
}

fs::path Trainer::latest_checkpoint(const fs::path& dir) {
  fs::path best;
  std::int64_t best_step = -1;
  if (!fs::is_directory(dir)) return best;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const auto name = entry.path().filename().string();
    if (!entry.is_directory() || name.rfind(kCheckpointPrefix, 0) != 0) continue;
    if (!fs::exists(entry.path() / "trainer.json")) continue;
    const auto digits = name.substr(std::string(kCheckpointPrefix).size());
    if (digits.empty() || !std::all_of(digits.begin(), digits.end(), ::isdigit)) continue;
    std::int64_t step = 0;
    const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
    if (error != std::errc() || end != digits.data() + digits.size()) continue;  // beyond int64: not one we wrote
    if (step > best_step) best_step = step, best = entry.path();
  }
  return best;
}

}  // namespace sbp
