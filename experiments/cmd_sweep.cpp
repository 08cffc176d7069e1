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
TensorList step_gradients(Model& model, BackpropMethod& method, Objective& objective, const Batch& batch) {
  method.step(model, objective, batch);
  TensorList grads;
  for (auto& g : model.gradients()) grads.push_back({g.name, g.tensor.clone()});
  model.zero_grad();
  return grads;
}

struct Check {
  std::string status;
  double max_normwise_rel = 0;
};

// fp64, every trainable tensor of every method against standard BP, on the sweep's model with a T that need not be a
// multiple of the chunk sizes (so the remainder chunk is exercised too). Standard BP is the reference itself.
std::map<std::string, Check> check_methods(const ModelSource& source, const std::vector<std::string>& specs,
                                           Objective& objective, const RandomBatchOptions& options,
                                           const std::string& lora) {
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
    out[spec] = {cmp.passed(1e-10) ? "passed" : "incorrect", cmp.max_normwise_rel()};
    for (const auto& p : cmp.problems) fmt::print("  problem: {}\n", p);
    fmt::print("  {:<44} max normwise relative error {:.2e}: {}\n", method->spec(), cmp.max_normwise_rel(),
               out[spec].status);
    std::fflush(stdout);
  }
  return out;
}

std::string format_duration(double seconds) {
  const auto s = std::int64_t(seconds + 0.5);
  return s >= 3600 ? fmt::format("{}h{:02}m", s / 3600, s % 3600 / 60) : fmt::format("{}m{:02}s", s / 60, s % 60);
}

}  // namespace

int run_sweep(const SweepPlan& plan, const std::string& command_line) {
  for (const auto B : plan.batch_sizes)
    if (B % plan.ranks.nproc != 0) throw InputError(uneven_batch(plan.ranks.nproc, "--batch " + std::to_string(B), B));
  const auto env = rank_from_environment();
  if (plan.ranks.nproc > 1 && !env) return launch_ranks(plan.ranks.nproc);
  const auto& setup = plan.setup;
  const auto ranks = join_ranks(plan.ranks, env, setup);
  const bool writer = ranks.writer();
  const auto device = ranks.device;
  const auto& lengths = plan.seq_lens;
  const auto& batches = plan.batch_sizes;
  if (lengths.empty() || batches.empty()) throw InputError("sweep: no sequence length or batch size given");
  std::vector<std::unique_ptr<BackpropMethod>> methods;
  std::vector<std::string> specs;  // canonical
  for (const auto& s : plan.methods) {
    methods.push_back(make_method(s));
    specs.push_back(methods.back()->spec());
  }
  if (methods.empty()) throw InputError("--methods: no method given");
  const auto seed = setup.seed;
  auto objective = build_objective(setup);
  auto model = build_model(setup);
  model->to(device);
  const auto precision = precision_name(model->dtype(), model->grad_dtype());
  const auto preset = setup.source.describe();
  // SFT: 10% of each row is prompt (no loss); GRPO/DPO draw their prompt lengths.
  const auto options = [&](std::int64_t B, std::int64_t T) {
    return RandomBatchOptions{B, T, 0.0, objective->name() == "sft" ? 0.1 : 0.0, seed, setup.group};
  };

  // Threads no more than the cores other processes leave free, unless --threads says otherwise: oversubscribed
  // OpenMP workers that spin while waiting distort every time, StreamBP's most (machine_load.h).
  const auto at_start = sample_machine_load(0.5);
  if (setup.threads == 0 && ranks.world == 1 && at_start.shared()) {
    const int cores = int(std::thread::hardware_concurrency());
    const int free = std::max(1, cores - int(at_start.other_cores + 0.5)), before = at::get_num_threads();
    if (free < before) {
      at::set_num_threads(free);
      if (writer)
        fmt::print(stderr, "note      the machine is shared ({}): {} thread(s) instead of {} (--threads N to choose)\n",
                   at_start.describe(), free, before);
    }
  }
  const std::vector<std::string> columns = {
      "objective", "lora", "batch_size", "seq_len", "peak_bytes", "model_peak_bytes", "peak_over_model", "bp_seconds",
      "bp_seconds_all", "seconds_per_sample", "time_vs_checkpoint", "budget_bytes", "check_max_normwise_rel",
      "check_seq", "check_batch", "check_dtype", "flops", "flops_per_second", "gemm_flops_per_second",
      "gemm_efficiency", "world_size", "zero", "timing", "other_cores", "steal", "cpu_per_wall", "load_before",
      "load_after"};
  ResultsTable table(columns);
  std::filesystem::path csv;
  nlohmann::json earlier = nlohmann::json::array();
  std::set<std::tuple<std::string, std::string, std::string>> done;  // (method, batch_size, seq_len)
  const auto prov = collect_provenance(command_line, describe_device(device));
  if (!plan.resume.empty()) {
    csv = plan.resume;
    table = ResultsTable::read(csv, &earlier);
    if (table.columns() != columns)
      throw InputError(csv.string() + ": --resume needs a CSV of this sweep's columns");
    for (const auto& r : table.rows()) {
      if (r.preset != preset || r.dtype != precision || table.value(r, "objective") != objective->spec() ||
          table.value(r, "lora") != (model->lora().enabled() ? model->lora().spec() : ""))
        throw InputError(fmt::format("{}: --resume with another model, dtype, objective or LoRA (the file "
                                                "has {} {} {} '{}')", csv.string(), r.preset, r.dtype,
                                                table.value(r, "objective"), table.value(r, "lora")));
      done.insert({r.method, table.value(r, "batch_size"), table.value(r, "seq_len")});
    }
    if (writer) fmt::print(stderr, "resuming {}: {} rows already measured\n", csv.string(), table.rows().size());
  } else {
    if (writer) std::filesystem::create_directories(plan.out_dir);
    csv = ResultsTable::new_path(plan.out_dir, plan.stem, prov);
  }

  if (writer)
    for (const auto& method : methods)
      for (const auto T : lengths)
        if (const auto advice = streambp_chunk_advice(*method, T); !advice.empty()) {
          fmt::print(stderr, "note      {}\n", advice);
          break;  // once per method: its first such length says it
        }
  std::map<std::string, Check> checks;
  if (plan.check_seq_len > 0 && writer)
    checks = check_methods(setup.source, specs, *objective, options(batches.front(), plan.check_seq_len), setup.lora);

  // Progress: work is counted in tokens (B * T per method and repeat), a rough proxy for time.
  double total_work = 0, finished_work = 0;
  for (const auto B : batches)
    for (const auto T : lengths)
      for (const auto& spec : specs)
        if (!done.count({spec, std::to_string(B), std::to_string(T)})) total_work += double(B * T) * plan.repeats;
  if (writer)
    fmt::print(stderr, "sweep: {} method(s) x {} batch size(s) x {} length(s) x {} repeat(s), interleaved{}; results in "
               "{}\n", methods.size(), batches.size(), lengths.size(), plan.repeats, ranks.describe(), csv.string());
  const auto started = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(); };
  // A data-parallel measurement: a fresh DataParallel and no-op Trainer per step (no optimizer states to hold).
  const auto noop_update = parse_optimizer_spec("sgd:lr=0");
  const auto measure_on_ranks = [&](BackpropMethod& method, const Batch& batch) {
    DataParallel parallel(*ranks.comm, ranks.zero);
    TrainOptions options;
    options.optimizer = noop_update;
    Trainer trainer(*model, method, *objective, options, &parallel);
    auto m = measure_training_on_ranks(trainer, ranks, batch, 0, 1, plan.budget_bytes);
    parallel.unshard();  // ZeRO-3: the next measurement starts from the whole model
    return m;
  };

  std::vector<std::string> lines, shared_points;
  lines.push_back(fmt::format("{:>3} {:>6}  {:<40} {:>10} {:>10} {:>7} {:>8} {:>8} {:>6}  {}", "B", "T", "method",
                              "peak", "analytic", "meas/an", "BP s", "vs ckpt", "%GEMM", "status"));
  bool all_passed = true;
  for (const auto B : batches)
    for (const auto T : lengths) {
      std::vector<std::size_t> todo;
      for (std::size_t i = 0; i < methods.size(); ++i)
        if (!done.count({specs[i], std::to_string(B), std::to_string(T)})) todo.push_back(i);
      if (todo.empty()) continue;
      // This rank's B / world rows of the global batch of B rows.
      auto batch = prepared_random_batch(*model, *objective, B, T, setup.group, seed);
      if (ranks.world > 1) batch = objective->split(batch, ranks.world, "random batch").at(std::size_t(ranks.rank));
      const auto workload = make_workload(*model, *objective, batch);
      std::map<std::size_t, Measurement> results;
      // The yardstick of the achieved FLOP/s: a dense GEMM in the compute dtype, same threads, sampled right before
      // every measured step (the speed of a shared machine drifts over minutes); the median sample is the rate.
      std::vector<double> gemm_samples;
      const auto point_start = read_cpu_counters();
      for (int r = 0; r < plan.repeats; ++r)
        for (const auto i : todo) {
          auto& result = results[i];
          if (result.status == "oom") continue;  // over the budget once: over it every time
          gemm_samples.push_back(gemm_flops_per_second(model->dtype(), 2048, 3, device));
          auto m = ranks.world == 1 ? measure_method(*model, *methods[i], *objective, batch, 0, 1, plan.budget_bytes)
                                    : measure_on_ranks(*methods[i], batch);
          finished_work += double(B * T);
          const double eta = finished_work > 0 ? elapsed() / finished_work * (total_work - finished_work) : 0;
          if (m.status == "error") throw std::runtime_error(specs[i] + " failed: " + m.error);
          if (writer)
            fmt::print(stderr, "  [B={} T={} repeat {}/{}] {:<40} {}  (elapsed {}, ETA {})\n", B, T, r + 1, plan.repeats,
                     specs[i], m.status == "oom" ? "oom (over the budget)" : fmt::format("{:7.2f} s  peak {}",
                     m.bp_seconds.at(0), format_bytes(m.peak_bytes)), format_duration(elapsed()), format_duration(eta));
          if (m.status == "oom") {
            finished_work += double(B * T) * (plan.repeats - r - 1);
            result = m;
            continue;
          }
          result.peak_bytes = std::max(result.peak_bytes, m.peak_bytes);
          result.bp_seconds.push_back(m.bp_seconds.at(0));
        }
      // What the machine did meanwhile (the yardstick GEMMs and the measured steps, this point's whole time).
      const auto load = load_between(point_start, read_cpu_counters());
      if (load.shared()) shared_points.push_back(fmt::format("B={} T={}: {}", B, T, load.describe()));
      const std::string timing = !load.known ? "" : load.shared() ? "shared" : "idle";
      if (gemm_samples.empty()) gemm_samples.push_back(gemm_flops_per_second(model->dtype(), 2048, 3, device));  // every method oom
      std::sort(gemm_samples.begin(), gemm_samples.end());
      const double gemm_rate = gemm_samples[gemm_samples.size() / 2];
      double checkpoint_seconds = 0;
      for (const auto i : todo)
        if (specs[i] == "checkpoint" && results[i].status != "oom") checkpoint_seconds = results[i].median_seconds();
      for (const auto i : todo) {
        const auto& m = results[i];
        const bool oom = m.status == "oom";
        // Data-parallel: the per-rank model of the step measured (a training step with the no-op update).
        auto w = workload;
        if (ranks.comm) {
          add_optimizer_memory(w, *model, noop_update);
          set_data_parallel(w, ranks.world, ranks.zero, device);
        }
        const auto est = (ranks.comm ? training_memory(*methods[i], w) : methods[i]->memory_model(w)).total_bytes();
        const bool reference = specs[i] == "standard";
        const auto check = reference ? Check{"reference", 0.0} : checks.count(specs[i]) ? checks[specs[i]] : Check{"unchecked", 0.0};
        all_passed = all_passed && check.status != "incorrect";
        const bool checked = check.status == "passed" || check.status == "incorrect";
        // Missing values are empty cells, never 0: no time or peak for an oom row, no ratio without a checkpoint row.
        const std::string ratio = !oom && checkpoint_seconds > 0 ? fmt::format("{:.4f}", m.median_seconds() / checkpoint_seconds) : "";
        std::string all;
        for (double s : m.bp_seconds) all += (all.empty() ? "" : " ") + fmt::format("{:.4f}", s);
        const double flops = methods[i]->flops(workload), rate = oom ? 0 : flops / m.median_seconds();
        table.add({preset, specs[i], precision, oom ? "oom" : check.status, seed,
                   {objective->spec(), model->lora().enabled() ? model->lora().spec() : "", std::to_string(B),
                    std::to_string(T), oom ? "" : std::to_string(m.peak_bytes), std::to_string(est),
                    oom ? "" : fmt::format("{:.4f}", double(m.peak_bytes) / double(est)),
                    oom ? "" : fmt::format("{:.4f}", m.median_seconds()), all,
                    oom ? "" : fmt::format("{:.4f}", m.median_seconds() / double(B)), ratio,
                    plan.budget_bytes > 0 ? std::to_string(plan.budget_bytes) : "",
                    checked ? fmt::format("{:.3e}", check.max_normwise_rel) : "",
                    // The check ran at its own size: say which, so `passed` is never read as "checked at this T".
                    checked ? std::to_string(plan.check_seq_len) : "", checked ? std::to_string(batches.front()) : "",
                    // fp64 runs on the CPU: a GPU row's check covers the method, not its CUDA attention kernel.
                    checked ? (device.is_cuda() ? "fp64 cpu" : "fp64") : "", fmt::format("{:.6g}", flops), oom ? "" : fmt::format("{:.6g}", rate),
                    fmt::format("{:.6g}", gemm_rate), oom ? "" : fmt::format("{:.4f}", rate / gemm_rate),
                    std::to_string(ranks.world), std::to_string(ranks.zero), timing,
                    load.known ? fmt::format("{:.3f}", load.other_cores) : "",
                    load.known ? fmt::format("{:.4f}", load.steal) : "", fmt::format("{:.3f}", load.own_per_wall),
                    load.load_before >= 0 ? fmt::format("{:.2f}", load.load_before) : "",
                    load.load_after >= 0 ? fmt::format("{:.2f}", load.load_after) : ""}});
        lines.push_back(fmt::format("{:>3} {:>6}  {:<40} {:>10} {:>10} {:>7} {:>8} {:>8} {:>6}  {}", B, T, specs[i],
                                    oom ? "oom" : format_bytes(m.peak_bytes), format_bytes(est),
                                    oom ? "-" : fmt::format("{:.3f}", double(m.peak_bytes) / double(est)),
                                    oom ? "-" : fmt::format("{:.2f}", m.median_seconds()),
                                    ratio.empty() ? "-" : ratio.substr(0, 5) + (load.shared() ? "*" : ""),
                                    oom ? "-" : fmt::format("{:.0f}%", 100 * rate / gemm_rate), oom ? "oom" : check.status));
      }
      if (writer) table.write_to(csv, prov, earlier);  // after every point: a killed sweep keeps what it finished
    }
  if (table.rows().empty()) throw InputError("the sweep has no points");
  if (!writer) return 0;
  table.write_to(csv, prov, earlier);
  fmt::print("\n");
  for (const auto& line : lines) fmt::print("{}\n", line);
  fmt::print("\npeak: the step's measured peak, the model's weights included (the batch, made before the step, is "
             "not); analytic: the method's memory model; meas/an: their ratio; BP s: median seconds of {} step(s); "
             "vs ckpt: BP s over checkpointing's in this run; %GEMM: the step's matrix-product FLOP/s as a share "
             "of a dense 2048^3 GEMM's, same dtype and threads; status: the fp64 gradient check against standard BP (reference: standard itself; unchecked: --check-seq 0)\n",
             plan.repeats);
  fmt::print("results: {} ({})\n", std::filesystem::absolute(csv).string(), format_duration(elapsed()));
  if (!shared_points.empty()) {
    fmt::print("\nWARNING: the machine was shared during {} of {} timed point(s); their times and ratios (marked * "
               "above, timing=shared in the CSV) say more about the other load than about the methods:\n",
               shared_points.size(), lengths.size() * batches.size());
    for (const auto& p : shared_points) fmt::print("  {}\n", p);
    fmt::print("Measure on an idle machine (docs/results.md, \"Measuring time honestly\"); peaks and checks are "
               "unaffected.\n");
  }
  return all_passed ? 0 : 1;
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
