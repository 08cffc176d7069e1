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

// What the optimizer updates: the trainable tensors as the features make them, in order.
TensorList optimizer_params_of(const TrainingFeatures& features, TensorList params) {
  for (const auto& f : features) params = f->optimizer_params(std::move(params));
  return params;
}

constexpr const char* kCheckpointPrefix = "checkpoint-";

std::string checkpoint_name(std::int64_t step) {
  auto digits = std::to_string(step);
  return kCheckpointPrefix + std::string(digits.size() < 6 ? 6 - digits.size() : 0, '0') + digits;
}

}  // namespace

Trainer::Trainer(Model& model, BackpropMethod& method, const Objective& objective, TrainOptions options,
                 DataParallel* parallel)
    : model_(model), method_(method), objective_(objective), options_(std::move(options)),
      features_(make_training_features(model, method, options_, parallel)),
      optimizer_params_(optimizer_params_of(features_, model.trainable())),
      optimizer_(optimizer_params_, options_.optimizer, options_.optimizer_tier) {
  if (options_.grad_accum < 1) throw InputError("--grad-accum must be >= 1");
  if (!options_.micro_batch_rows.empty() && options_.grad_accum != 1)
    throw InputError("--micro-batches gives the step's micro-batches: --grad-accum is then 1");
  if (options_.total_steps < 1) throw InputError("--steps must be >= 1");
  if (!(options_.clip_grad_norm >= 0)) throw InputError("--clip-grad-norm must be >= 0");
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
    const auto t = objective_.prepare(m, model_.config(), std::nullopt, source).batch_totals();
    totals.rows += t.rows;
    totals.tokens += t.tokens;
  }
  for (const auto& f : features_) f->count_totals(totals);
  out.tokens = totals.tokens;
  {
    // What the features hold while the micro-batches run (their subscriptions), released in reverse, also on a throw.
    std::vector<Subscription> held;
    for (const auto& f : features_)
      for (auto& s : f->begin_micro_batches(batch, source)) held.push_back(std::move(s));
    for (std::size_t k = 0; k < micro.size(); ++k) {
      if (k + 1 == micro.size())
        for (const auto& f : features_)
          for (auto& s : f->begin_last_micro_batch()) held.push_back(std::move(s));
      const auto r = method_.step(model_, objective_, micro[k], {.accumulate = k > 0, .step_totals = totals});
      out.loss += r.loss;
      out.bp_seconds += r.bp_seconds;
    }
    while (!held.empty()) held.pop_back();
  }
  for (const auto& f : features_) out.loss = f->step_loss(out.loss);
  const auto start = std::chrono::steady_clock::now();
  // Without clipping the norm is still reported: a coefficient of exactly 1 leaves every gradient bit as it was.
  const double max_norm =
      options_.clip_grad_norm > 0 ? options_.clip_grad_norm : std::numeric_limits<double>::infinity();
  for (const auto& f : features_) f->before_update();
  out.grad_norm = clip_gradients(max_norm);
  out.lr = lr_at(options_.schedule, options_.optimizer.lr, optimizer_.steps_taken(), options_.total_steps);
  optimizer_.step(out.lr);
  for (const auto& f : features_) f->after_update();
  synchronize(model_.device());
  out.optimizer_seconds = seconds_since(start);
  out.step = optimizer_.steps_taken();
  return out;
}

double Trainer::clip_gradients(double max_norm) {
  for (const auto& f : features_)
    if (const auto norm = f->clip_grad_norm(optimizer_params_, max_norm)) return *norm;
  std::vector<at::Tensor> params;
  for (const auto& p : optimizer_params_) params.push_back(p.tensor);
  return clip_grad_norm(params, max_norm);
}

Trainer::~Trainer() = default;
Trainer::Trainer(Trainer&&) = default;

Trainer::WholeModel::WholeModel(const Trainer& trainer, bool keep) : trainer_(trainer), keep_(keep) {
  for (const auto& f : trainer_.features_) f->whole_model(true, false);
}

Trainer::WholeModel::~WholeModel() {
  for (const auto& f : trainer_.features_) f->whole_model(false, keep_);
}

void Trainer::add_optimizer_memory(Workload& workload) const {
  for (const auto& f : features_) f->describe(workload);
  // What this rank's optimizer updates, exactly: the tensors, this rank's slices of them (ZeRO 1-3; at stage 3 the
  // model's own tensors are empty between uses) or their homes (the model's tensors are empty between uses).
  const auto& trainable = model_.trainable();
  const bool own = trainable.size() == optimizer_params_.size() &&
                   std::equal(trainable.begin(), trainable.end(), optimizer_params_.begin(),
                              [](const NamedTensor& a, const NamedTensor& b) { return a.tensor.is_same(b.tensor); });
  if (own) return sbp::add_optimizer_memory(workload, model_, options_.optimizer);
  std::vector<ParamShape> shapes;
  for (const auto& p : optimizer_params_) shapes.push_back({p.name, p.tensor.sizes().vec(), p.tensor.scalar_type()});
  const auto m = optimizer_memory(options_.optimizer, shapes);
  workload.optimizer_state_bytes = m.state_bytes;
  workload.optimizer_update_bytes = m.step_temporary_bytes;
}

std::int64_t Trainer::held_bytes() const {
  std::int64_t bytes = optimizer_.device_state_bytes();
  for (const auto& f : features_) bytes += f->held_bytes();
  return bytes;
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
  const WholeModel whole(*this);
  auto state = optimizer_.state();
  bool writes = true;
  for (const auto& f : features_) {
    state = f->whole_state(std::move(state));
    writes = writes && f->writes_checkpoints();
  }
  if (!writes) return {};
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
  auto state = read_safetensors(state_file);
  for (const auto& f : features_) state = f->sliced_state(std::move(state));
  optimizer_.load_state(state, state_file.string());
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
