#include "experiments/train_session.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "baselines/methods.h"
#include "core/io/dtype.h"
#include "core/io/input_error.h"
#include "core/io/safetensors.h"
#include "core/methods/memory_model.h"
#include "core/model/checkpoint_io.h"
#include "core/model/gemm.h"
#include "core/offload/offload_tier.h"
#include "core/training/data_parallel.h"
#include "core/training/trainer.h"
#include "core/training/training_memory.h"
#include "experiments/exit_status.h"
#include "experiments/interrupt.h"
#include "experiments/memory_check.h"
#include "experiments/memory_record.h"
#include "experiments/provenance.h"
#include "experiments/results_table.h"
#include "experiments/train_metrics.h"
#include "profiler/calibration.h"

namespace sbp {

namespace fs = std::filesystem;

std::string metrics_sidecar(const std::string& metrics) {
  return metrics.empty() ? "" : fs::path(metrics).replace_extension(".json").string();
}

namespace {

// What makes a run's random batches, as its record and a resume's check see it (--pack only when given, so that the
// settings of runs without it stay as they were).
nlohmann::json random_batch_settings(const RunArgs& r) {
  nlohmann::json j = {{"B", r.measure.batch_size()}, {"T", r.measure.seq_len()}, {"pad", r.pad_fraction},
                      {"prompt", r.prompt_fraction}, {"group", r.setup.group}};
  if (r.pack.packed()) j["pack"] = r.pack.spec();
  return j;
}


std::vector<fs::path> batch_files(const std::string& dir) {
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && e.path().extension() == ".safetensors") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  if (files.empty()) throw InputError("--data " + dir + ": no .safetensors batch files");
  return files;
}

// Everything that decides the trajectory, compared on --resume (the method may differ: every method is exact).
nlohmann::json trajectory_fingerprint(const TrainArgs& a, const Model& model, const Objective& objective,
                                      const std::string& optimizer) {
  const auto& r = a.run;
  return {{"model", r.setup.source.describe()},
          {"precision", precision_name(model.dtype(), model.grad_dtype())},
          {"lora", r.setup.lora_spec},
          {"adapter", r.setup.adapter_dir},
          {"objective", objective.spec()},
          {"seed", r.setup.seed},
          {"data", a.data_dir},
          {"batch", a.data_dir.empty() ? random_batch_settings(r) : nlohmann::json()},
          {"ref", r.ref_dir},
          {"optimizer", optimizer},
          {"optimizer_state_dtype", a.optimizer.state_dtype},
          {"lr_schedule", a.lr_schedule},
          {"steps", a.steps},
          {"clip_grad_norm", a.clip_grad_norm},
          {"grad_accum", a.grad_accum},
          {"micro_batches", a.micro_batches}};
}

// Whether any rank raised `flag` (one process: its own). Every rank asks at the same moment, so that all of them
// act alike: one stopping alone would leave the others waiting in a collective.
bool any_rank(Communicator* comm, bool flag) {
  if (!comm) return flag;
  std::vector<at::Tensor> sum = {at::full({1}, flag ? 1.0 : 0.0, at::TensorOptions(at::kFloat).device(comm->device()))};
  comm->all_reduce_sum(sum);
  return sum[0].item<double>() > 0;
}

// Before the first step: the model's peak of a step against what the process may use (experiments/memory_check.h),
// so that a run that cannot fit stops in seconds instead of after its first minutes. The ranks decide together.
// Returns why it does not fit ("": it does).
std::string memory_refusal(const BackpropMethod& method, const Workload& workload, const Model& model,
                           std::int64_t held_bytes, Communicator* comm) {
  const auto check = check_workload_memory([&](const Workload& w) { return training_memory(method, w); }, workload,
                                           /*budget_bytes=*/0, model.device().is_cpu(), held_bytes);
  if (!any_rank(comm, !check.fits())) return "";
  return check.fits() ? "another rank's step does not fit its memory"
                      : memory_shortfall(check, workload.batch_size);
}

std::string eta_text(double seconds) {
  const auto s = std::int64_t(std::llround(seconds));
  return fmt::format("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60);
}

// The ranks must run the same thing: every fingerprint entry (and the method) hashed and gathered; the first that
// differs is named with the ranks that disagree.
void check_ranks_agree(Communicator& comm, const nlohmann::json& fingerprint, const std::string& method) {
  std::vector<std::pair<std::string, std::string>> items = {{"method", method}};
  for (const auto& [key, value] : fingerprint.items()) items.push_back({key, value.dump()});
  std::vector<std::int64_t> hashes;
  for (const auto& [key, text] : items) hashes.push_back(std::int64_t(std::hash<std::string>{}(text) >> 1));
  if (const auto d = first_disagreement(comm, hashes))
    throw InputError(fmt::format("rank {} and rank 0 disagree on {} (this rank's: {})", d->rank,
                                 items[d->index].first, items[d->index].second));
}

// The collectives of `kind` that `comm` ran since its last reset (none without a communicator).
CollectiveStats stats_of(const Communicator* comm, const char* kind) {
  return comm && comm->stats().count(kind) ? comm->stats().at(kind) : CollectiveStats{};
}

// What the steps of this invocation add up to, for the summary and the record.
struct RunTotals {
  double seconds = 0, first_loss = 0, last_loss = 0;
  std::int64_t tokens = 0;
  std::int64_t peak_bytes = 0;  // the largest step's (this rank's)
};

class TrainSession {
 public:
  // Joins the ranks, checks this rank's flags and outputs, and builds the model, method, objective, offload tier and
  // trainer; nothing is trained yet.
  TrainSession(const TrainArgs& args, const TrainPlan& plan, const std::string& command_line);

  // Resume, loop, finish; returns the exit code.
  int run();

 private:
  // Opening
  void check_outputs() const;
  TrainOptions train_options() const;
  void build_trainer();
  // Resume
  void resume();
  void check_trajectory(const fs::path& checkpoint, const nlohmann::json& saved) const;
  void note_kept_gemm_paths() const;
  // Loop
  void open_metrics();
  void announce() const;
  int loop();
  std::pair<Batch, std::string> batch_for_step(std::int64_t s);
  bool first_step_fits(const Batch& batch, const std::string& source);
  StepMetrics take_step(const Batch& batch, const std::string& source);
  void report_step(std::int64_t s, const StepMetrics& m);
  void write_metrics() const;
  void save(std::int64_t step);
  bool stop_after_step(std::int64_t step);
  // Finish
  int finish();
  std::vector<std::int64_t> rank_peaks() const;
  void write_record(const std::vector<std::int64_t>& rank_peaks) const;
  void print_summary() const;

  bool stepped() const { return trainer_->steps_taken() > start_step_; }
  Model& model() const { return *parts_.model; }
  BackpropMethod& method() const { return *parts_.method; }
  const Objective& objective() const { return *parts_.objective; }

  const TrainArgs& a_;
  const RunArgs& r_;
  const TrainPlan& plan_;
  const std::string& command_line_;
  // Declared in the order they are built: the trainer goes first at the end (with parameter offload it puts the
  // model's tensors back on the device, from the tier).
  Ranks ranks_;
  bool writer_ = false;  // rank 0 writes every output; the ranks hold the same model after every step
  bool random_ = false;  // seeded random batches (no --data)
  TrainOptions options_;
  RunParts parts_;
  std::unique_ptr<OffloadTier> tier_;
  std::vector<fs::path> files_;  // --data's batch files
  nlohmann::json fingerprint_;
  std::unique_ptr<DataParallel> parallel_;
  std::unique_ptr<Trainer> trainer_;

  std::int64_t start_step_ = 0;
  std::vector<std::string> metric_rows_;
  Provenance prov_;
  CpuMemoryMeter* meter_ = nullptr;
  bool metered_ = false;  // the CPU meter's peaks (not on CUDA)
  std::int64_t weight_bytes_ = 0;
  std::optional<MemoryEstimate> estimate_;  // of the first step's micro-batch shape
  RunTotals totals_;
  std::chrono::steady_clock::time_point run_start_;
  std::int64_t last_saved_step_ = -1;
};

TrainSession::TrainSession(const TrainArgs& a, const TrainPlan& plan, const std::string& command_line)
    : a_(a), r_(a.run), plan_(plan), command_line_(command_line), ranks_(join_ranks(a.ranks, plan.env, a.run.setup)) {
  writer_ = ranks_.rank == 0;
  random_ = a_.data_dir.empty();
  check_outputs();
  options_ = train_options();
  parts_ = build_run_parts(r_);
  tier_ = make_offload(r_.offload, ranks_.device, method(), /*training=*/true, a_.ranks.nproc, a_.ranks.zero);  // its folder first
  if (r_.offload.checkpoints()) method().offload_checkpoints_to(tier_.get());
  if (r_.offload.optimizer()) options_.optimizer_tier = tier_.get();
  if (r_.offload.gradients()) options_.gradient_tier = tier_.get();
  model().to(ranks_.device);
  if (!random_) files_ = batch_files(a_.data_dir);
  build_trainer();
}

// This rank's flags, and (rank 0) the outputs it will write: each new unless --force, or kept by a finished run.
void TrainSession::check_outputs() const {
  if (random_ && r_.measure.seq_len() == 0) throw InputError("give --seq T (and --batch B) or --data DIR");
  if (!random_ && r_.measure.seq_len() != 0) throw InputError("--seq and --data exclude each other");
  if (a_.save_every > 0 && a_.checkpoint_dir.empty() && a_.resume_dir.empty())
    throw InputError("--save-every needs --checkpoint-dir DIR (or --resume DIR)");
  if (writer_) {
    if (!r_.json.empty() && !plan_.keep_json) check_new_output(r_.json, r_.force, "--json");
    if (!r_.save_grads.empty()) check_new_output(r_.save_grads, r_.force, "--save-grads");
    if (!r_.save_model.empty() && !plan_.keep_model) check_new_folder(r_.save_model, r_.force, "--save-model");
    if (!r_.save_adapter.empty() && !plan_.keep_adapter) check_new_folder(r_.save_adapter, r_.force, "--save-adapter");
    if (!a_.checkpoint_dir.empty())
      if (const auto why = unwritable_folder(a_.checkpoint_dir); !why.empty())
        throw InputError("--checkpoint-dir " + a_.checkpoint_dir + ": " + why);
  }
  // The checkpoint folder exists from the start, so that a run killed before its first checkpoint is resumed (from
  // step 0) with the same --resume as any other.
  if (writer_ && a_.save_every > 0) fs::create_directories(plan_.checkpoint_dir);
  if (!r_.save_adapter.empty() && !r_.setup.lora.enabled() && r_.setup.adapter_dir.empty())
    throw InputError("--save-adapter needs --lora or --adapter");
}

TrainOptions TrainSession::train_options() const {
  TrainOptions options;
  options.optimizer = *a_.optimizer.options();
  options.schedule = parse_lr_schedule(a_.lr_schedule);
  options.total_steps = a_.steps;
  options.grad_accum = a_.grad_accum;
  options.micro_batch_rows = plan_.micro_rows;
  options.clip_grad_norm = a_.clip_grad_norm;
  return options;
}

// The ranks agree on the trajectory before their first collective of a step; data-parallel, the parameter offload is
// DataParallel's (ZeRO-3's slices), else the trainer's own.
void TrainSession::build_trainer() {
  fingerprint_ = trajectory_fingerprint(a_, model(), objective(), optimizer_spec(options_.optimizer));
  if (Communicator* comm = ranks_.comm.get()) {
    check_ranks_agree(*comm, fingerprint_, method().spec());
    parallel_ = std::make_unique<DataParallel>(*comm, ranks_.zero, r_.offload.parameters() ? tier_.get() : nullptr);
  }
  if (r_.offload.parameters() && !parallel_) options_.parameter_tier = tier_.get();
  ranks_.add_to(options_);
  trainer_ = std::make_unique<Trainer>(model(), method(), objective(), options_, parallel_.get());
}

int TrainSession::run() {
  resume();
  open_metrics();
  prov_ = collect_provenance(command_line_, describe_device(ranks_.device));
  announce();
  meter_ = &CpuMemoryMeter::install();
  metered_ = !ranks_.device.is_cuda();
  weight_bytes_ = model_weight_bytes(model());
  run_start_ = std::chrono::steady_clock::now();
  if (const int code = loop(); code != 0) return code;
  return finish();
}

// --resume: the latest complete checkpoint of the folder (none: from step 0), refused when it was written for another
// trajectory.
void TrainSession::resume() {
  if (a_.resume_dir.empty()) return;
  const auto latest = Trainer::latest_checkpoint(a_.resume_dir);
  if (latest.empty()) {
    fmt::print(stderr, "resume    {}: no complete checkpoint, starting at step 0\n", a_.resume_dir);
    return;
  }
  const auto saved = trainer_->load_checkpoint(latest);
  check_trajectory(latest, saved.at("trajectory"));
  start_step_ = trainer_->steps_taken();
  fmt::print(stderr, "resume    {} (step {})\n", latest.string(), start_step_);
  note_kept_gemm_paths();
}

// Every fingerprint entry as the checkpoint saved it, but a longer --steps of a schedule that does not depend on it.
void TrainSession::check_trajectory(const fs::path& latest, const nlohmann::json& saved) const {
  for (const auto& [key, value] : fingerprint_.items()) {
    if (saved.contains(key) && saved.at(key) == value) continue;
    // A longer --steps extends the run where the learning rates already taken do not depend on the total (the
    // constant schedule, with or without warmup); cosine decays over --steps: say why it cannot.
    if (key == "steps" && saved.contains(key) && saved.at(key).is_number_integer() &&
        a_.steps > saved.at(key).get<std::int64_t>()) {
      const auto saved_steps = saved.at(key).get<std::int64_t>();
      if (options_.schedule.kind != ScheduleKind::Constant)
        throw InputError(fmt::format(
            "{}: the run was written for --steps {}, this one asks {}: the {} schedule decays over --steps, so the "
            "learning rates of the steps already taken belong to a {}-step run and a longer one is another "
            "trajectory. Resume with --steps {}, or start a new run from its weights (--save-model DIR, then "
            "--load DIR)", latest.string(), saved_steps, a_.steps, schedule_kind_name(options_.schedule.kind),
            saved_steps, saved_steps));
      if (writer_)
        fmt::print(stderr, "extend    the run was written for --steps {}; it trains on to {} (its {} schedule does "
                           "not depend on --steps, so the steps taken are those of a {}-step run)\n",
                   saved_steps, a_.steps, schedule_kind_name(options_.schedule.kind), a_.steps);
      continue;
    }
    throw InputError(latest.string() + ": the checkpoint's " + key + " is " +
                     (saved.contains(key) ? saved.at(key).dump() : "missing") + ", this run's " + value.dump() +
                     " (resume with the arguments of the run that wrote it)");
  }
}

// The checkpoint's bf16 GEMM paths are kept (the run continues bitwise), also where this machine would take the other
// path: say so, as the native path can be far slower on a CPU without bf16 kernels.
void TrainSession::note_kept_gemm_paths() const {
  if (!writer_ || gemm_paths_reason(model().dtype()).empty()) return;
  const auto [here, why] = machine_gemm_paths(model().dtype());
  if (gemm_paths(model().dtype()).describe() != here.describe())
    fmt::print(stderr, "note      the checkpoint's {} GEMM paths ({}) are kept so that the run continues "
                       "bitwise; this machine's own would be {} ({})\n", dtype_name(model().dtype()),
               gemm_paths(model().dtype()).describe(), here.describe(), why);
}

// --metrics: a resumed run keeps the rows up to its checkpoint; otherwise the file and its sidecar are new (a resume
// from step 0 replaces them).
void TrainSession::open_metrics() {
  if (a_.metrics.empty() || !writer_) return;
  if (fs::exists(a_.metrics) && start_step_ > 0 && !r_.force) {
    metric_rows_ = read_metrics_rows(a_.metrics, metrics_header(), start_step_);
    return;
  }
  const bool replace = r_.force || (start_step_ == 0 && !a_.resume_dir.empty());
  check_new_output(a_.metrics, replace, "--metrics");
  check_new_output(metrics_sidecar(a_.metrics), replace, "--metrics (its .json sidecar)");
}

void TrainSession::announce() const {
  if (!writer_) return;
  if (plan_.finished)
    fmt::print(stderr, "train     nothing to do: {} holds step {} and --steps is {}, so the run is finished and the "
                       "outputs it wrote stay as they are; a larger --steps trains on (with a constant schedule)\n",
               a_.resume_dir, start_step_, a_.steps);
  else
    fmt::print(stderr, "train     {} on {} ({}), {} {}, steps {}..{} of {}{}\n", method().spec(),
               r_.setup.source.describe(), precision_name(model().dtype(), model().grad_dtype()),
               optimizer_spec(options_.optimizer), lr_schedule_spec(options_.schedule), start_step_ + 1, a_.steps,
               a_.steps, ranks_.describe());
  for (const auto& [dtype, choice] : chosen_gemm_paths())
    fmt::print(stderr, "kernels   {} GEMMs {} ({})\n", dtype, choice.first, choice.second);
  if (random_ && !plan_.finished)
    fmt::print(stderr, "data      random batches (no --data): fresh random tokens every step, so the loss shows the "
                       "method at work, not learning; --data DIR trains on batch files (--save-batch writes them)\n");
}

int TrainSession::loop() {
  watch_interrupts("\ninterrupt: stopping after this step to write a checkpoint (Ctrl-C again to stop now)\n");
  for (std::int64_t s = start_step_; s < a_.steps; ++s) {
    const auto [batch, source] = batch_for_step(s);
    if (!estimate_ && !first_step_fits(batch, source)) return kExitOutOfMemory;
    const auto m = take_step(batch, source);
    report_step(s, m);
    metric_rows_.push_back(metrics_row(m));
    write_metrics();
    const bool last = m.step.step == a_.steps;
    // Every rank takes part (ZeRO gathers its slices into whole tensors); rank 0 writes.
    if (!plan_.checkpoint_dir.empty() && a_.save_every > 0 && (m.step.step % a_.save_every == 0 || last))
      save(m.step.step);
    if (!last && stop_after_step(m.step.step)) return kInterruptedExit;
  }
  return 0;
}

// The global batch of step s (0-based): file s mod n, or a random batch seeded by seed + s (step 0 is `run`'s batch
// of the same seed), its log-probs completed by the current policy. Data-parallel: this rank's rows of it
// (Objective::split: DPO keeps pairs), the same on every rank count.
std::pair<Batch, std::string> TrainSession::batch_for_step(std::int64_t s) {
  // Named as the progress lines count steps, from 1.
  const auto source = random_ ? fmt::format("random batch of step {}", s + 1) : files_[s % files_.size()].string();
  Batch batch = random_ ? objective().random_batch(model().config(), {r_.measure.batch_size(), r_.measure.seq_len(),
                                                                      r_.pad_fraction, r_.prompt_fraction,
                                                                      r_.setup.seed + std::uint64_t(s), r_.setup.group,
                                                                      r_.pack})
                        : read_batch_file(files_[s % files_.size()]);
  validate_tokens(batch, model().config(), source);
  if (ranks_.data_world() > 1 && batch.batch_size() % ranks_.data_world() != 0)
    throw InputError(uneven_batch(ranks_.data_world(), source, batch.batch_size()));
  // A random batch's synthetic log-probs are drawn for the whole global batch (then split), so that every rank
  // count trains on the same numbers; a file's reference pass runs on this rank's rows only.
  const auto complete = [&] {
    // ZeRO-3, parameter offload: the log-probs need the whole model (every rank takes part in gathering it).
    const Trainer::WholeModel whole(*trainer_);
    complete_batch(model(), objective(), batch, source, random_, r_.ref_dir, parts_.dtype,
                   r_.setup.seed + std::uint64_t(s));
  };
  batch = batch.to(ranks_.device);
  if (random_) complete();
  if (ranks_.data_world() > 1)
    batch = objective().split(batch, ranks_.data_world(), source).at(std::size_t(ranks_.data_rank()));
  if (!random_) complete();
  return {batch, source};
}

// The memory model of the first step's micro-batch shape (estimate_), and whether the step fits what the process may
// use (false: refused, said on rank 0; --no-memory-check trains anyway).
bool TrainSession::first_step_fits(const Batch& batch, const std::string& source) {
  const auto micro = trainer_->micro_batches(batch, source);
  auto workload =
      make_workload(model(), objective().prepare(micro.front(), model().config(), std::nullopt, source), micro.front());
  trainer_->add_optimizer_memory(workload);
  workload.accumulating = micro.size() > 1;
  r_.offload.add_to(workload);
  estimate_ = training_memory(method(), workload);
  if (a_.no_memory_check) return true;
  const auto why = memory_refusal(method(), workload, model(), weight_bytes_ + trainer_->held_bytes(), ranks_.comm.get());
  if (why.empty()) return true;
  if (writer_) fmt::print(stderr, "streambp: out of memory: not run: {} (--no-memory-check trains anyway)\n", why);
  return false;
}

// One optimizer step, with its measured peak and its collectives; the run's totals take it in.
StepMetrics TrainSession::take_step(const Batch& batch, const std::string& source) {
  model().zero_grad();  // the previous step's gradients are not part of this step
  meter_->reset_peak();
  // As `run` counts: the step's peak with the model's weights and the optimizer's states, not what else the
  // process holds (the batch, the data's files).
  const auto held = meter_->current_bytes() - weight_bytes_ - trainer_->held_bytes();
  Communicator* comm = ranks_.comm.get();
  const Communicator* group = ranks_.sequence.get();
  if (comm) comm->reset_stats();
  if (ranks_.sequence) ranks_.sequence->reset_stats();
  const auto t = trainer_->step(batch, source);
  const auto step_peak = meter_->peak_bytes() - held;
  totals_.peak_bytes = std::max(totals_.peak_bytes, step_peak);
  if (t.step == start_step_ + 1) totals_.first_loss = t.loss;
  totals_.last_loss = t.loss;
  totals_.tokens += t.tokens;
  totals_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start_).count();
  return {.step = t,
          .peak_bytes = metered_ ? std::optional(step_peak) : std::nullopt,
          .world_size = ranks_.world,
          .zero = ranks_.zero,
          .sp = ranks_.sp,
          .all_reduce = stats_of(comm, "all_reduce"),
          .reduce_scatter = stats_of(comm, "reduce_scatter"),
          .all_gather = stats_of(comm, "all_gather"),
          .sp_all_gather = stats_of(group, "all_gather"),
          .sp_reduce_scatter = stats_of(group, "reduce_scatter"),
          .sp_all_reduce = stats_of(group, "all_reduce"),
          .sp_ring_shift = stats_of(group, "ring_shift")};
}

// The progress line of step s (0-based), its time to the end from the mean step so far.
void TrainSession::report_step(std::int64_t s, const StepMetrics& m) {
  if (!writer_) return;
  const auto& t = m.step;
  const double per_step = totals_.seconds / double(s + 1 - start_step_);
  fmt::print(stderr, "step {}/{}  loss {:.6g}  grad_norm {:.4g}  lr {:.4g}  {:.0f} tok/s  peak {}  ETA {}\n", t.step,
             a_.steps, t.loss, t.grad_norm, t.lr, double(t.tokens) / (t.bp_seconds + t.optimizer_seconds),
             m.peak_bytes ? format_bytes(*m.peak_bytes) : "-", eta_text(per_step * double(a_.steps - t.step)));
}

// The whole metrics file and its sidecar, rewritten after every step (atomically: a kill leaves the last whole one).
void TrainSession::write_metrics() const {
  if (a_.metrics.empty() || !writer_) return;
  std::ostringstream csv;
  csv << metrics_header() << "\n";
  for (const auto& row : metric_rows_) csv << row << "\n";
  write_file_atomically(a_.metrics, csv.str());
  const nlohmann::json sidecar = {{"provenance", to_json(prov_)},
                                  {"method", method().spec()},
                                  {"trajectory", fingerprint_},
                                  {"narrow_gemm", narrow_gemm_json()},
                                  {"columns", metrics_header()},
                                  {"peak_bytes", "live tensor bytes at the step's peak (CPU allocator meter): "
                                                 "weights, optimizer states and what the step allocates, as `run` "
                                                 "counts (not the batch); empty on CUDA"}};
  write_file_atomically(metrics_sidecar(a_.metrics), sidecar.dump(2) + "\n");
}

void TrainSession::save(std::int64_t step) {
  const auto dir = trainer_->save_checkpoint(plan_.checkpoint_dir, {{"trajectory", fingerprint_},
                                                                    {"method", method().spec()},
                                                                    {"provenance", to_json(prov_)}});
  last_saved_step_ = step;
  if (writer_) fmt::print(stderr, "checkpoint {}\n", dir.string());
}

// After a step: stop when a Ctrl-C arrived on any rank (all of them agree, or one would wait in the next step's
// collectives forever), with a checkpoint of this step where there is a folder for it and the command that resumes.
bool TrainSession::stop_after_step(std::int64_t step) {
  if (!any_rank(ranks_.comm.get(), interrupted())) return false;
  const auto& dir = plan_.checkpoint_dir;
  if (!dir.empty() && last_saved_step_ != step) save(step);
  if (!writer_) return true;
  if (dir.empty())
    fmt::print(stderr, "stopped   after step {} of {} (Ctrl-C); no checkpoint: a run that can be resumed needs "
                       "--checkpoint-dir DIR --save-every K\n", step, a_.steps);
  else
    fmt::print(stderr, "stopped   after step {} of {} (Ctrl-C); resume with:\n  {}\n", step, a_.steps,
               command_line_.find(" --resume ") != std::string::npos ? command_line_
                                                                     : command_line_ + " --resume " + shell_quote(dir));
  return true;
}

// The peaks against the model, every rank's peak, the final outputs, the record and the summary.
int TrainSession::finish() {
  const auto world = ranks_.world;
  // Data-parallel: the model is of one rank (rank 0's slices, the longest), printed beside rank 0's peak; every
  // rank's is in the JSON.
  const auto peak = totals_.peak_bytes;
  if (writer_ && estimate_ && metered_ && stepped())
    fmt::print(stderr, "peak      {}{} measured, {} analytic{} ({:+.1f}%, peak at {})\n", world > 1 ? "rank 0: " : "",
               format_bytes(peak), format_bytes(estimate_->total_bytes()),
               world > 1 ? fmt::format(" per rank of {} ({})", world, ranks_.zero == 0 ? "DDP" : fmt::format("ZeRO-{}", ranks_.zero)) : "",
               100.0 * (double(peak) / double(estimate_->total_bytes()) - 1.0), estimate_->moment);
  if (writer_ && tier_ && estimate_ && stepped())
    fmt::print(stderr, "offload   {} in {}: {} held at the tier's peak, {} analytic\n", r_.offload.describe(),
               tier_->describe(), format_bytes(tier_->peak_bytes()), format_bytes(estimate_->host_bytes()));
  const auto peaks = rank_peaks();
  // ZeRO-3, parameter offload: the final model is whole (on every rank) before rank 0 writes it.
  const Trainer::WholeModel whole(*trainer_);
  if (!writer_) return 0;
  if (world > 1 && metered_ && stepped()) {
    std::string list;
    for (std::size_t q = 0; q < peaks.size(); ++q)
      list += fmt::format("{}rank {} {}", q ? ", " : "", q, format_bytes(peaks[q]));
    fmt::print(stderr, "peak      per rank: {}\n", list);
  }
  // The last step's gradients are still the model's: the next step would zero them.
  if (!r_.save_grads.empty() && stepped())
    save_gradients(model(), r_.save_grads, {{"method", method().spec()},
                                            {"dtype", precision_name(model().dtype(), model().grad_dtype())},
                                            {"commit", prov_.commit}, {"command", prov_.command}});
  if (!r_.save_model.empty() && !plan_.keep_model) save_model_dir(model(), r_.save_model);
  if (!r_.save_adapter.empty() && !plan_.keep_adapter)
    save_adapter_dir(model(), r_.save_adapter, r_.setup.source.describe());
  if (!r_.json.empty() && !plan_.keep_json) write_record(peaks);
  print_summary();
  return 0;
}

// Every rank's peak (also a barrier: every rank finished its steps before rank 0 reports).
std::vector<std::int64_t> TrainSession::rank_peaks() const {
  std::vector<std::int64_t> peaks = {totals_.peak_bytes};
  if (Communicator* comm = ranks_.comm.get()) {
    const auto all = comm->all_gather(at::tensor(std::vector<std::int64_t>{totals_.peak_bytes},
                                                 at::TensorOptions(at::kLong).device(comm->device()))).cpu();
    peaks.assign(all.data_ptr<std::int64_t>(), all.data_ptr<std::int64_t>() + all.numel());
  }
  return peaks;
}

// --json: what ran and what it measured beside the model's terms (a value the run did not reach is null).
void TrainSession::write_record(const std::vector<std::int64_t>& rank_peaks) const {
  const auto unless_none = [](bool have, nlohmann::json value) { return have ? value : nlohmann::json(); };
  nlohmann::json j = {
      {"status", "completed"},
      {"steps", trainer_->steps_taken()},
      {"start_step", start_step_},
      {"final_loss", unless_none(stepped(), totals_.last_loss)},
      {"seconds", totals_.seconds},
      {"peak_bytes", unless_none(metered_ && stepped(), totals_.peak_bytes)},
      {"optimizer_state_bytes", trainer_->optimizer().state_bytes()},
      {"method", method().spec()},
      {"world_size", ranks_.world},
      {"zero", ranks_.zero},
      {"rank_peak_bytes", unless_none(metered_ && stepped(), rank_peaks)},
      {"trajectory", fingerprint_},
      {"narrow_gemm", narrow_gemm_json()},
      {"metrics", a_.metrics},
      {"device", describe_device(ranks_.device)},
      {"provenance", to_json(prov_)}};
  j.update(memory_record(estimate_ ? &*estimate_ : nullptr, r_.offload.describe(), tier_.get()));
  write_file_atomically(r_.json, j.dump(2) + "\n");
}

// The end, in a few lines: what ran, how it went, where everything is.
void TrainSession::print_summary() const {
  if (stepped())
    fmt::print(stderr, "done      steps {}..{} in {:.1f} s ({:.0f} tokens/s over the run); loss {:.6g} at step {}, {:.6g} "
                       "at step {}\n", start_step_ + 1, trainer_->steps_taken(), totals_.seconds,
               double(totals_.tokens) / std::max(totals_.seconds, 1e-9), totals_.first_loss, start_step_ + 1,
               totals_.last_loss, trainer_->steps_taken());
  std::string outputs;
  const auto add = [&](const char* what, const std::string& where) {
    if (!where.empty()) outputs += (outputs.empty() ? "" : "; ") + std::string(what) + " " + where;
  };
  if (plan_.finished) {  // what this invocation wrote: the outputs the finished run did not have
    add("model", plan_.keep_model ? "" : r_.save_model);
    add("adapter", plan_.keep_adapter ? "" : r_.save_adapter);
    add("record", plan_.keep_json ? "" : r_.json);
    fmt::print(stderr, "outputs   {}\n", outputs.empty() ? "none new" : outputs + " (of the final checkpoint, step " +
                                                                           std::to_string(start_step_) + ")");
    return;
  }
  add("gradients", r_.save_grads);
  add("model", r_.save_model);
  add("adapter", r_.save_adapter);
  add("metrics", a_.metrics);
  add("checkpoints", a_.save_every > 0 ? plan_.checkpoint_dir : std::string());
  add("record", r_.json);
  fmt::print(stderr, "outputs   {}\n", outputs.empty() ? "none (--save-model, --metrics, --checkpoint-dir, --json)" : outputs);
}

}  // namespace

int run_train_session(const TrainArgs& args, const TrainPlan& plan, const std::string& command_line) {
  TrainSession session(args, plan, command_line);
  return session.run();
}

}  // namespace sbp
