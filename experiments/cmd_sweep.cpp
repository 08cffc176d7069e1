// The measurement sweep behind `streambp demo` and `streambp sweep seq|batch|partition` (issue #9: Fig. 3 / Table 1,
// Table 2, Fig. 5): for every batch size B and sequence length T, every BP method measured with the methods
// interleaved repeat by repeat (slow drifts of a shared machine hit all of them alike): peak bytes from the CPU
// meter, the analytic model, BP time (median) as a ratio to checkpointing in the same run, per-sample time; runs over
// the byte budget are rows with status `oom`. Each method's gradient is checked once, in fp64 against standard BP at
// --check-seq, and the row says so (check_seq, check_batch, check_dtype). The CSV is rewritten atomically after every
// (B, T) point, so a killed sweep keeps what it finished; --resume FILE continues it, skipping the rows it has.
// Data-parallel (--nproc N, Table 5): every point's global batch of B rows is split over the ranks (B / N each; B must
// divide), and a measured step is a data-parallel BP (forward, backward and the gradient reduction at each group's
// event) through the Trainer with a no-op update (SGD, lr 0, no states); time is the slowest rank's, the peak the
// largest rank's (ranks.h), per-sample time is per row of the global batch. The fp64 check runs on rank 0 alone.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <set>
#include <thread>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "baselines/methods.h"
#include "core/io/dtype.h"
#include "core/methods/memory_model.h"
#include "core/training/training_memory.h"
#include "core/methods/streambp.h"
#include "core/training/data_parallel.h"
#include "core/training/optimizer.h"
#include "core/training/trainer.h"
#include "experiments/commands.h"
#include "experiments/cli_checks.h"
#include "experiments/machine_load.h"
#include "experiments/results_table.h"
#include "verify/grad_compare.h"
#include "core/io/input_error.h"

namespace sbp {
namespace {

// Gradients of a step, detached copies (the model's grads are freed by the next step).
TensorList step_gradients(Model& model, BackpropMethod& method, const Objective& objective, const Batch& batch) {
  method.step(model, objective, batch);
  TensorList grads;
  for (auto& g : model.gradients()) grads.push_back({g.name, g.tensor.clone()});
  model.zero_grad();
  return grads;
}

struct Check {
  CheckStatus status = CheckStatus::unchecked;
  double max_normwise_rel = 0;
};

// fp64, every trainable tensor of every method against standard BP, on the sweep's model with a T that need not be a
// multiple of the chunk sizes (so the remainder chunk is exercised too). Standard BP is the reference itself.
std::map<std::string, Check> check_methods(const ModelSource& source, const std::vector<std::string>& specs,
                                           const Objective& objective, const RandomBatchOptions& options,
                                           const LoraConfig& lora) {
  fmt::print("gradient check: fp64, {}, B={}, T={}, every trainable tensor against standard (rtol 1e-10)\n",
             objective.spec(), options.batch_size, options.seq_len);
  auto model = build_model(source, at::kDouble, options.seed);
  apply_lora(*model, lora, "", options.seed);
  auto batch = objective.random_batch(model->config(), options);
  complete_batch(*model, objective, batch, "random batch", true, "", at::kDouble, options.seed);
  auto standard = make_method("standard");
  const auto reference = step_gradients(*model, *standard, objective, batch);
  std::map<std::string, Check> out;
  for (const auto& spec : specs) {
    auto method = make_method(spec);
    if (method->spec() == "standard") continue;
    const auto cmp = compare_gradients(reference, step_gradients(*model, *method, objective, batch),
                                       {"standard", method->spec()});
    out[spec] = {cmp.passed(1e-10) ? CheckStatus::passed : CheckStatus::incorrect, cmp.max_normwise_rel()};
    for (const auto& p : cmp.problems) fmt::print("  problem: {}\n", p);
    fmt::print("  {:<44} max normwise relative error {:.2e}: {}\n", method->spec(), cmp.max_normwise_rel(),
               check_status_name(out[spec].status));
    std::fflush(stdout);
  }
  return out;
}

std::string format_duration(double seconds) {
  const auto s = std::int64_t(seconds + 0.5);
  return s >= 3600 ? fmt::format("{}h{:02}m", s / 3600, s % 3600 / 60) : fmt::format("{}m{:02}s", s / 60, s % 60);
}

const std::vector<std::string>& sweep_columns() {
  static const std::vector<std::string> columns = {
      "objective", "lora", "batch_size", "seq_len", "peak_bytes", "model_peak_bytes", "peak_over_model", "bp_seconds",
      "bp_seconds_all", "seconds_per_sample", "time_vs_checkpoint", "budget_bytes", "check_max_normwise_rel",
      "check_seq", "check_batch", "check_dtype", "flops", "flops_per_second", "gemm_flops_per_second",
      "gemm_efficiency", "world_size", "zero", "timing", "other_cores", "steal", "cpu_per_wall", "load_before",
      "load_after"};
  return columns;
}

// Threads no more than the cores other processes leave free, unless --threads says otherwise: oversubscribed
// OpenMP workers that spin while waiting distort every time, StreamBP's most (machine_load.h).
void use_free_cores(const Setup& setup, const Ranks& ranks) {
  const auto at_start = sample_machine_load(0.5);
  if (setup.threads != 0 || ranks.world != 1 || !at_start.shared()) return;
  const int cores = int(std::thread::hardware_concurrency());
  const int free = std::max(1, cores - int(at_start.other_cores + 0.5)), before = at::get_num_threads();
  if (free >= before) return;
  at::set_num_threads(free);
  if (ranks.writer())
    fmt::print(stderr, "note      the machine is shared ({}): {} thread(s) instead of {} (--threads N to choose)\n",
               at_start.describe(), free, before);
}

// The sweep's CSV: a new file in the results folder, or --resume's, whose points are not measured again.
struct SweepFile {
  ResultsTable table{sweep_columns()};
  std::filesystem::path csv;
  nlohmann::json earlier = nlohmann::json::array();  // the runs of --resume's sidecar
  std::set<std::tuple<std::string, std::string, std::string>> done;  // (method, batch_size, seq_len) it holds
  bool has(const std::string& spec, std::int64_t B, std::int64_t T) const {
    return done.count({spec, std::to_string(B), std::to_string(T)}) > 0;
  }
};

// What one (B, T) point measured: each method's repeats (by index into the sweep's methods), the dense GEMM's rate
// beside them and what the rest of the machine did meanwhile.
struct PointResults {
  std::map<std::size_t, Measurement> results;
  double gemm_rate = 0;
  MachineLoad load;
};

// One sweep on this rank: every method at every (B, T), a point's methods interleaved repeat by repeat, the CSV
// rewritten after every point, the table and verdict at the end.
class Sweep {
 public:
  Sweep(const SweepPlan& plan, const std::optional<RankEnv>& env, const std::string& command_line);
  int run();  // 0: every check passed; 1: one is incorrect

 private:
  void open_file();
  void advise_chunks() const;
  Measurement measure_once(std::size_t i, const Batch& batch);
  PointResults measure_point(std::int64_t B, std::int64_t T, const std::vector<std::size_t>& todo, const Batch& batch);
  void add_rows(std::int64_t B, std::int64_t T, const std::vector<std::size_t>& todo, const Workload& workload,
                PointResults& point);
  int summarize();
  double elapsed() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  }

  const SweepPlan& plan_;
  const Setup& setup_;
  const std::string& command_line_;
  Ranks ranks_;
  bool writer_ = false;
  std::vector<std::unique_ptr<BackpropMethod>> methods_;
  std::vector<std::string> specs_;  // canonical
  std::shared_ptr<const Objective> objective_;
  std::unique_ptr<Model> model_;
  std::string precision_, preset_;
  Provenance prov_;
  SweepFile file_;
  std::map<std::string, Check> checks_;
  // A data-parallel measurement's update: none in effect (SGD at lr 0, no states to hold).
  const OptimizerOptions noop_update_ = parse_optimizer_spec("sgd:lr=0");
  // Progress: work is counted in tokens (B * T per method and repeat), a rough proxy for time.
  double total_work_ = 0, finished_work_ = 0;
  std::chrono::steady_clock::time_point started_;
  std::vector<std::string> lines_, shared_points_;
  bool all_passed_ = true;
};

Sweep::Sweep(const SweepPlan& plan, const std::optional<RankEnv>& env, const std::string& command_line)
    : plan_(plan), setup_(plan.setup), command_line_(command_line), ranks_(join_ranks(plan.ranks, env, plan.setup)) {
  writer_ = ranks_.writer();
  if (plan_.seq_lens.empty() || plan_.batch_sizes.empty())
    throw InputError("sweep: no sequence length or batch size given");
  for (const auto& s : plan_.methods) {
    methods_.push_back(make_method(s));
    specs_.push_back(methods_.back()->spec());
  }
  if (methods_.empty()) throw InputError("--methods: no method given");
  objective_ = build_objective(setup_);
  model_ = build_model(setup_);
  model_->to(ranks_.device);
  precision_ = precision_name(model_->dtype(), model_->grad_dtype());
  preset_ = setup_.source.describe();
}

// --resume: the file's rows, all of this model, dtype, objective and LoRA; else a new file in the results folder.
void Sweep::open_file() {
  prov_ = collect_provenance(command_line_, describe_device(ranks_.device));
  if (plan_.resume.empty()) {
    if (writer_) std::filesystem::create_directories(plan_.out_dir);
    file_.csv = ResultsTable::new_path(plan_.out_dir, plan_.stem, prov_);
    return;
  }
  file_.csv = plan_.resume;
  file_.table = ResultsTable::read(file_.csv, &file_.earlier);
  const auto& table = file_.table;
  if (table.columns() != sweep_columns())
    throw InputError(file_.csv.string() + ": --resume needs a CSV of this sweep's columns");
  for (const auto& r : table.rows()) {
    if (r.preset != preset_ || r.dtype != precision_ || table.value(r, "objective") != objective_->spec() ||
        table.value(r, "lora") != (model_->lora().enabled() ? model_->lora().spec() : ""))
      throw InputError(fmt::format("{}: --resume with another model, dtype, objective or LoRA (the file "
                                   "has {} {} {} '{}')", file_.csv.string(), r.preset, r.dtype,
                                   table.value(r, "objective"), table.value(r, "lora")));
    file_.done.insert({r.method, table.value(r, "batch_size"), table.value(r, "seq_len")});
  }
  if (writer_) fmt::print(stderr, "resuming {}: {} rows already measured\n", file_.csv.string(), table.rows().size());
}

void Sweep::advise_chunks() const {
  if (!writer_) return;
  for (const auto& method : methods_)
    for (const auto T : plan_.seq_lens)
      if (const auto advice = streambp_chunk_advice(*method, T); !advice.empty()) {
        fmt::print(stderr, "note      {}\n", advice);
        break;  // once per method: its first such length says it
      }
}

int Sweep::run() {
  const auto& lengths = plan_.seq_lens;
  const auto& batches = plan_.batch_sizes;
  use_free_cores(setup_, ranks_);
  open_file();
  advise_chunks();
  // SFT: 10% of each row is prompt (no loss); GRPO/DPO draw their prompt lengths.
  if (plan_.check_seq_len > 0 && writer_)
    checks_ = check_methods(setup_.source, specs_, *objective_,
                            {batches.front(), plan_.check_seq_len, 0.0, objective_->default_prompt_fraction(),
                             setup_.seed, setup_.group},
                            setup_.lora);
  for (const auto B : batches)
    for (const auto T : lengths)
      for (const auto& spec : specs_)
        if (!file_.has(spec, B, T)) total_work_ += double(B * T) * plan_.repeats;
  if (writer_)
    fmt::print(stderr, "sweep: {} method(s) x {} batch size(s) x {} length(s) x {} repeat(s), interleaved{}; results in "
               "{}\n", methods_.size(), batches.size(), lengths.size(), plan_.repeats, ranks_.describe(),
               file_.csv.string());
  started_ = std::chrono::steady_clock::now();
  lines_.push_back(fmt::format("{:>3} {:>6}  {:<40} {:>10} {:>10} {:>7} {:>8} {:>8} {:>6}  {}", "B", "T", "method",
                               "peak", "analytic", "meas/an", "BP s", "vs ckpt", "%GEMM", "status"));
  for (const auto B : batches)
    for (const auto T : lengths) {
      std::vector<std::size_t> todo;
      for (std::size_t i = 0; i < methods_.size(); ++i)
        if (!file_.has(specs_[i], B, T)) todo.push_back(i);
      if (todo.empty()) continue;
      // This rank's B / world rows of the global batch of B rows.
      auto batch = prepared_random_batch(*model_, *objective_, B, T, setup_.group, setup_.seed);
      if (ranks_.world > 1) batch = objective_->split(batch, ranks_.world, "random batch").at(std::size_t(ranks_.rank));
      const auto workload = make_workload(*model_, objective_->prepare(batch, model_->config()), batch);
      auto point = measure_point(B, T, todo, batch);
      add_rows(B, T, todo, workload, point);
      // After every point: a killed sweep keeps what it finished.
      if (writer_) file_.table.write_to(file_.csv, prov_, file_.earlier);
    }
  if (file_.table.rows().empty()) throw InputError("the sweep has no points");
  if (!writer_) return 0;
  return summarize();
}

// One step of method i: alone, or data-parallel through a fresh DataParallel and no-op Trainer.
Measurement Sweep::measure_once(std::size_t i, const Batch& batch) {
  if (ranks_.world == 1) return measure_method(*model_, *methods_[i], *objective_, batch, 0, 1, plan_.budget_bytes);
  DataParallel parallel(*ranks_.comm, ranks_.zero);
  TrainOptions options;
  options.optimizer = noop_update_;
  Trainer trainer(*model_, *methods_[i], *objective_, options, &parallel);
  auto m = measure_training_on_ranks(trainer, ranks_, batch, 0, 1, plan_.budget_bytes);
  parallel.unshard();  // ZeRO-3: the next measurement starts from the whole model
  return m;
}

// The point's methods interleaved repeat by repeat, each step preceded by a yardstick GEMM: a dense GEMM in the
// compute dtype, same threads (the speed of a shared machine drifts over minutes); the median sample is the rate.
PointResults Sweep::measure_point(std::int64_t B, std::int64_t T, const std::vector<std::size_t>& todo,
                                  const Batch& batch) {
  PointResults point;
  std::vector<double> gemm_samples;
  const auto point_start = read_cpu_counters();
  for (int r = 0; r < plan_.repeats; ++r)
    for (const auto i : todo) {
      auto& result = point.results[i];
      if (!result.finished()) continue;  // over the budget once: over it every time
      gemm_samples.push_back(gemm_flops_per_second(model_->dtype(), 2048, 3, ranks_.device));
      auto m = measure_once(i, batch);
      finished_work_ += double(B * T);
      const double eta = finished_work_ > 0 ? elapsed() / finished_work_ * (total_work_ - finished_work_) : 0;
      if (writer_)
        fmt::print(stderr, "  [B={} T={} repeat {}/{}] {:<40} {}  (elapsed {}, ETA {})\n", B, T, r + 1, plan_.repeats,
                   specs_[i], !m.finished() ? "oom (over the budget)" : fmt::format("{:7.2f} s  peak {}",
                   m.bp_seconds.at(0), format_bytes(m.peak_bytes)), format_duration(elapsed()), format_duration(eta));
      if (!m.finished()) {
        finished_work_ += double(B * T) * (plan_.repeats - r - 1);
        result = m;
        continue;
      }
      result.peak_bytes = std::max(result.peak_bytes, m.peak_bytes);
      result.bp_seconds.push_back(m.bp_seconds.at(0));
    }
  // What the machine did meanwhile (the yardstick GEMMs and the measured steps, this point's whole time).
  point.load = load_between(point_start, read_cpu_counters());
  if (point.load.shared()) shared_points_.push_back(fmt::format("B={} T={}: {}", B, T, point.load.describe()));
  if (gemm_samples.empty())  // every method oom
    gemm_samples.push_back(gemm_flops_per_second(model_->dtype(), 2048, 3, ranks_.device));
  std::sort(gemm_samples.begin(), gemm_samples.end());
  point.gemm_rate = gemm_samples[gemm_samples.size() / 2];
  return point;
}

// The point's rows (CSV and the printed table), one per method, beside the model's peak and the method's check.
void Sweep::add_rows(std::int64_t B, std::int64_t T, const std::vector<std::size_t>& todo, const Workload& workload,
                     PointResults& point) {
  const auto& load = point.load;
  const double gemm_rate = point.gemm_rate;
  const std::string timing = !load.known ? "" : load.shared() ? "shared" : "idle";
  double checkpoint_seconds = 0;
  for (const auto i : todo)
    if (specs_[i] == "checkpoint" && point.results[i].finished())
      checkpoint_seconds = point.results[i].median_seconds();
  const auto& batches = plan_.batch_sizes;
  for (const auto i : todo) {
    const auto& m = point.results[i];
    const bool oom = !m.finished();
    // Data-parallel: the per-rank model of the step measured (a training step with the no-op update).
    auto w = workload;
    if (ranks_.comm) {
      add_optimizer_memory(w, *model_, noop_update_);
      ranks_.add_to(w);
    }
    const auto est = (ranks_.comm ? training_memory(*methods_[i], w) : methods_[i]->memory_model(w)).total_bytes();
    const bool reference = specs_[i] == "standard";
    const auto check = reference ? Check{CheckStatus::reference} : checks_.count(specs_[i]) ? checks_[specs_[i]] : Check{};
    all_passed_ = all_passed_ && check.status != CheckStatus::incorrect;
    const bool checked = check.status == CheckStatus::passed || check.status == CheckStatus::incorrect;
    const std::string status = oom ? step_status_name(StepStatus::oom) : check_status_name(check.status);
    // Missing values are empty cells, never 0: no time or peak for an oom row, no ratio without a checkpoint row.
    const std::string ratio = !oom && checkpoint_seconds > 0 ? fmt::format("{:.4f}", m.median_seconds() / checkpoint_seconds) : "";
    std::string all;
    for (double s : m.bp_seconds) all += (all.empty() ? "" : " ") + fmt::format("{:.4f}", s);
    const double flops = methods_[i]->flops(workload), rate = oom ? 0 : flops / m.median_seconds();
    file_.table.add({preset_, specs_[i], precision_, status, setup_.seed,
                     {objective_->spec(), model_->lora().enabled() ? model_->lora().spec() : "", std::to_string(B),
                      std::to_string(T), oom ? "" : std::to_string(m.peak_bytes), std::to_string(est),
                      oom ? "" : fmt::format("{:.4f}", double(m.peak_bytes) / double(est)),
                      oom ? "" : fmt::format("{:.4f}", m.median_seconds()), all,
                      oom ? "" : fmt::format("{:.4f}", m.median_seconds() / double(B)), ratio,
                      plan_.budget_bytes > 0 ? std::to_string(plan_.budget_bytes) : "",
                      checked ? fmt::format("{:.3e}", check.max_normwise_rel) : "",
                      // The check ran at its own size: say which, so `passed` is never read as "checked at this T".
                      checked ? std::to_string(plan_.check_seq_len) : "", checked ? std::to_string(batches.front()) : "",
                      // fp64 runs on the CPU: a GPU row's check covers the method, not its CUDA attention kernel.
                      checked ? (ranks_.device.is_cuda() ? "fp64 cpu" : "fp64") : "", fmt::format("{:.6g}", flops),
                      oom ? "" : fmt::format("{:.6g}", rate),
                      fmt::format("{:.6g}", gemm_rate), oom ? "" : fmt::format("{:.4f}", rate / gemm_rate),
                      std::to_string(ranks_.world), std::to_string(ranks_.zero), timing,
                      load.known ? fmt::format("{:.3f}", load.other_cores) : "",
                      load.known ? fmt::format("{:.4f}", load.steal) : "", fmt::format("{:.3f}", load.own_per_wall),
                      load.load_before >= 0 ? fmt::format("{:.2f}", load.load_before) : "",
                      load.load_after >= 0 ? fmt::format("{:.2f}", load.load_after) : ""}});
    lines_.push_back(fmt::format("{:>3} {:>6}  {:<40} {:>10} {:>10} {:>7} {:>8} {:>8} {:>6}  {}", B, T, specs_[i],
                                 oom ? "oom" : format_bytes(m.peak_bytes), format_bytes(est),
                                 oom ? "-" : fmt::format("{:.3f}", double(m.peak_bytes) / double(est)),
                                 oom ? "-" : fmt::format("{:.2f}", m.median_seconds()),
                                 ratio.empty() ? "-" : ratio.substr(0, 5) + (load.shared() ? "*" : ""),
                                 oom ? "-" : fmt::format("{:.0f}%", 100 * rate / gemm_rate), status));
  }
}

// Rank 0, at the end: the whole file once more, the table, what its columns mean, and a warning when the machine
// was shared; the exit code follows the checks.
int Sweep::summarize() {
  file_.table.write_to(file_.csv, prov_, file_.earlier);
  fmt::print("\n");
  for (const auto& line : lines_) fmt::print("{}\n", line);
  fmt::print("\npeak: the step's measured peak, the model's weights included (the batch, made before the step, is "
             "not); analytic: the method's memory model; meas/an: their ratio; BP s: median seconds of {} step(s); "
             "vs ckpt: BP s over checkpointing's in this run; %GEMM: the step's matrix-product FLOP/s as a share "
             "of a dense 2048^3 GEMM's, same dtype and threads; status: the fp64 gradient check against standard BP (reference: standard itself; unchecked: --check-seq 0)\n",
             plan_.repeats);
  fmt::print("results: {} ({})\n", std::filesystem::absolute(file_.csv).string(), format_duration(elapsed()));
  if (!shared_points_.empty()) {
    fmt::print("\nWARNING: the machine was shared during {} of {} timed point(s); their times and ratios (marked * "
               "above, timing=shared in the CSV) say more about the other load than about the methods:\n",
               shared_points_.size(), plan_.seq_lens.size() * plan_.batch_sizes.size());
    for (const auto& p : shared_points_) fmt::print("  {}\n", p);
    fmt::print("Measure on an idle machine (docs/results.md, \"Measuring time honestly\"); peaks and checks are "
               "unaffected.\n");
  }
  return all_passed_ ? 0 : 1;
}

}  // namespace

int run_sweep(const SweepPlan& plan, const std::string& command_line) {
  for (const auto B : plan.batch_sizes)
    if (B % plan.ranks.nproc != 0) throw InputError(uneven_batch(plan.ranks.nproc, "--batch " + std::to_string(B), B));
  const auto env = rank_from_environment();
  if (plan.ranks.nproc > 1 && !env) return launch_ranks(plan.ranks.nproc);
  Sweep sweep(plan, env, command_line);
  return sweep.run();
}

// Each kind's defaults, in one place: sweep_command fills the plan from them and --help shows them (for the kind
// named before --help, else for every kind).
struct SweepKind {
  const char* name;
  std::vector<std::int64_t> seq_lens, batch_sizes;
  std::vector<std::string> methods;  // empty: partition's checkpoint + StreamBP over --layer-chunks x --head-chunks
};
const SweepKind kSweepKinds[] = {{"seq", {1024, 2048, 4096, 8192}, {1}, {"standard", "checkpoint", "mst", "streambp"}},
                                 {"batch", {2048}, {1, 2, 4}, {"checkpoint", "mst", "streambp"}},
                                 {"partition", {4096}, {1}, {}}};

const SweepKind& sweep_kind(const std::string& name) {
  for (const auto& k : kSweepKinds)
    if (name == k.name) return k;
  throw InputError("sweep: unknown kind '" + name + "' (seq, batch, partition)");
}

std::string sweep_defaults_help(const std::string& kind) {
  std::string out = "Defaults (model qwen3-small, results in results/<kind>):";
  for (const auto& k : kSweepKinds)
    if (kind.empty() || kind == k.name)
      out += fmt::format("\n  sweep {:<9}  --seq {}  --batch {}  --methods {}", k.name, join_values(k.seq_lens),
                         join_values(k.batch_sizes), !k.methods.empty() ? fmt::format("\"{}\"", join_values(k.methods, ';'))
                                   : std::string("checkpoint and streambp:layer_chunk=L,head_chunk=H for every L of "
                                                 "--layer-chunks and H of --head-chunks"));
  return out;
}

void add_sweep_options(CLI::App& app, SweepArgs& a) {
  app.add_option("kind", a.kind, "seq (peak and time vs T: Fig. 3, Table 1), batch (per-sample time vs B: Table 2) or "
                 "partition (StreamBP's layer x head chunk sizes: Fig. 5)")->required()->check(CLI::IsMember({"seq", "batch", "partition"}));
  add_setup_options(app, a.setup, {.adapter = false, .default_preset = "qwen3-small"});
  add_methods_option(app, a.methods, "the methods of every point (default by kind: below)");
  add_measure_options(app, a.measure, {.seq = Arity::many, .batch = Arity::many, .repeats = true, .check_seq = true,
                                       .budget = true});
  app.add_option("--layer-chunks", a.layer_chunks, "partition: StreamBP layer chunk sizes (comma-separated)")
      ->delimiter(',')->check(sbp::within(std::int64_t(1), std::int64_t(1) << 40))->default_str(join_values(a.layer_chunks));
  app.add_option("--head-chunks", a.head_chunks, "partition: StreamBP head chunk sizes (comma-separated)")
      ->delimiter(',')->check(sbp::within(std::int64_t(1), std::int64_t(1) << 40))->default_str(join_values(a.head_chunks));
  add_output_options(app, a.output, "results folder, default results/<kind>");
  app.add_option("--resume", a.resume, "continue the sweep that wrote this CSV: rows it has are not measured again")->check(CLI::ExistingFile);
  add_rank_options(app, a.ranks, "each back-propagating its --batch / N rows of every point's global batch (a "
                   "data-parallel BP: the gradients reduced at each group's event, a no-op update)");
  // Called when --help is printed, after the kind (if given) was parsed: `sweep seq --help` shows seq's defaults.
  app.footer([&a] { return sweep_defaults_help(a.kind); });
}

int sweep_command(const SweepArgs& a, const std::string& command_line) {
  SweepPlan plan;
  plan.setup = a.setup;
  plan.repeats = a.measure.repeats, plan.check_seq_len = a.measure.check_seq_len;
  plan.budget_bytes = a.measure.budget_bytes, plan.resume = a.resume, plan.stem = a.kind;
  plan.ranks = a.ranks;
  plan.out_dir = a.output.out_dir.empty() ? "results/" + a.kind : a.output.out_dir;
  const auto& kind = sweep_kind(a.kind);
  plan.seq_lens = a.measure.seq_lens.empty() ? kind.seq_lens : a.measure.seq_lens;
  plan.batch_sizes = a.measure.batch_sizes.empty() ? kind.batch_sizes : a.measure.batch_sizes;
  if (!a.methods.empty()) {
    plan.methods = a.methods;
  } else if (!kind.methods.empty()) {
    plan.methods = kind.methods;
  } else {  // partition: checkpointing and every StreamBP chunking of the grid
    plan.methods = {"checkpoint"};
    for (const auto lc : a.layer_chunks)
      for (const auto hc : a.head_chunks) plan.methods.push_back(fmt::format("streambp:layer_chunk={},head_chunk={}", lc, hc));
  }
  return run_sweep(plan, command_line);
}

}  // namespace sbp
