// `streambp demo`: the headline side-by-side. For each sequence length and BP method: measured peak memory, its
// analytic model, BP time (median of repeats, methods interleaved in one run, reported as a ratio to checkpoint)
// and the method's gradient check (fp64, every parameter against standard BP).
#include <cstdio>
#include <map>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "baselines/methods.h"
#include "core/dtype.h"
#include "experiments/commands.h"
#include "experiments/results_table.h"
#include "verify/grad_compare.h"

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

// fp64, every parameter tensor of every method against standard BP, on the demo's preset with a T that is not a
// multiple of the chunk sizes (so the remainder chunk is exercised too).
std::map<std::string, Check> check_methods(const ModelConfig& config, const std::vector<std::string>& specs,
                                           Objective& objective, const RandomBatchOptions& options,
                                           const std::string& lora) {
  fmt::print("gradient check: fp64, {}, B={}, T={}, every parameter against standard (rtol 1e-10)\n", objective.spec(),
             options.batch_size, options.seq_len);
  Model model(config, at::kDouble, options.seed);
  apply_lora(model, lora, "", options.seed);
  auto batch = objective.random_batch(config, options);
  complete_batch(model, objective, batch, "random batch", true, "", at::kDouble, options.seed);
  auto standard = make_method("standard");
  const auto reference = step_gradients(model, *standard, objective, batch);
  std::map<std::string, Check> out;
  for (const auto& spec : specs) {
    auto method = make_method(spec);
    if (method->spec() == standard->spec()) {
      out[spec] = {"reference", 0.0};  // the oracle itself
      continue;
    }
    const auto cmp = compare_gradients(reference, step_gradients(model, *method, objective, batch));
    out[spec] = {cmp.passed(1e-10) ? "passed" : "incorrect", cmp.max_normwise_rel()};
    fmt::print("  {:<44} max normwise relative error {:.2e}: {}\n", method->spec(), cmp.max_normwise_rel(),
               out[spec].status);
    std::fflush(stdout);
  }
  return out;
}

}  // namespace

void add_demo_options(CLI::App& app, DemoArgs& a) {
  app.add_option("--preset", a.preset, "model preset");
  app.add_option("--dtype", a.dtype, "dtype of the measured runs")->check(CLI::IsMember({"fp32", "bf16", "fp64"}));
  app.add_option("--grad-dtype", a.grad_dtype, "fp32 with --dtype bf16: mixed precision (see run --help)")->check(CLI::IsMember({"fp32", "bf16", "fp64"}));
  app.add_option("--seq", a.seq_lens, "comma-separated sequence lengths");
  app.add_option("--methods", a.methods, "semicolon-separated method specs");
  app.add_option("--objective", a.objective, "objective spec (sft, grpo:..., dpo:...; see run --help)");
  app.add_option("--lora", a.lora, "LoRA spec for every method (see run --help)");
  app.add_option("--batch", a.batch_size, "rows per batch (DPO: chosen + rejected, even)")->check(CLI::PositiveNumber);
  app.add_option("--group", a.group, "GRPO: completions per prompt (default: the whole batch)")->check(CLI::PositiveNumber);
  app.add_option("--repeats", a.repeats, "measured steps per method and length (median)")->check(CLI::PositiveNumber);
  app.add_option("--check-seq", a.check_seq_len, "T of the fp64 gradient check (0 = skip)")->check(CLI::NonNegativeNumber);
  app.add_option("--threads", a.threads, "intra-op threads (default: torch's)")->check(CLI::NonNegativeNumber);
  app.add_option("--out", a.out_dir, "results folder");
}

int demo_command(const DemoArgs& a, const std::string& command_line) {
  if (a.threads > 0) at::set_num_threads(a.threads);
  const auto dtype = parse_dtype(a.dtype);
  const auto config = preset_config(a.preset);
  const auto specs = split_list(a.methods, ';');
  std::vector<std::unique_ptr<BackpropMethod>> methods;
  for (const auto& s : specs) methods.push_back(make_method(s));
  std::vector<std::int64_t> lengths;
  for (const auto& t : split_list(a.seq_lens, ',')) lengths.push_back(std::stoll(t));
  const std::uint64_t seed = 0;
  auto objective = make_objective(a.objective);
  // SFT: 10% of each row is prompt (no loss); GRPO/DPO draw their prompt lengths.
  const auto options = [&](std::int64_t T) {
    return RandomBatchOptions{a.batch_size, T, 0.0, objective->name() == "sft" ? 0.1 : 0.0, seed, a.group};
  };

  std::map<std::string, Check> checks;
  if (a.check_seq_len > 0) checks = check_methods(config, specs, *objective, options(a.check_seq_len), a.lora);

  Model model(config, dtype, seed);
  apply_lora(model, a.lora, "", seed);
  if (!a.grad_dtype.empty()) model.set_grad_dtype(parse_dtype(a.grad_dtype));
  const auto precision = precision_name(model.dtype(), model.grad_dtype());
  ResultsTable table({"objective", "lora", "batch_size", "seq_len", "peak_bytes", "model_peak_bytes", "peak_over_model", "bp_seconds",
                      "bp_seconds_all", "time_vs_checkpoint", "check_max_normwise_rel", "check_seq", "check_batch",
                      "check_dtype"});
  fmt::print(stderr, "measuring {} method(s) x {} length(s) x {} repeat(s), interleaved (progress on stderr)\n",
             methods.size(), lengths.size(), a.repeats);
  std::vector<std::string> table_lines;
  table_lines.push_back(fmt::format("{:>6}  {:<40} {:>10} {:>10} {:>7} {:>8} {:>8}  {}", "T", "method", "peak", "analytic", "meas/an",
             "BP s", "vs ckpt", "grad check"));
  bool all_passed = true;
  for (const auto T : lengths) {
    auto batch = objective->random_batch(config, options(T));
    complete_batch(model, *objective, batch, "random batch", true, "", dtype, seed);
    objective->prepare(batch, config, "random batch");
    const auto workload = make_workload(model, *objective, batch);
    std::vector<Measurement> results(methods.size());
    // Methods interleaved repeat by repeat, so slow drifts of this shared machine hit all of them alike.
    for (int r = 0; r < a.repeats; ++r)
      for (std::size_t i = 0; i < methods.size(); ++i) {
        auto m = measure_method(model, *methods[i], *objective, batch, 0, 1, 0);
        if (m.status != "passed") throw std::runtime_error(methods[i]->spec() + " failed: " + m.error);
        fmt::print(stderr, "  [T={} repeat {}/{}] {:<40} {:7.2f} s  peak {}\n", T, r + 1, a.repeats,
                   methods[i]->spec(), m.bp_seconds.at(0), format_bytes(m.peak_bytes));
        results[i].peak_bytes = std::max(results[i].peak_bytes, m.peak_bytes);
        results[i].bp_seconds.push_back(m.bp_seconds.at(0));
      }
    double checkpoint_seconds = 0;
    for (std::size_t i = 0; i < methods.size(); ++i)
      if (methods[i]->spec() == "checkpoint") checkpoint_seconds = results[i].median_seconds();
    for (std::size_t i = 0; i < methods.size(); ++i) {
      const auto& m = results[i];
      const auto est = methods[i]->memory_model(workload).total_bytes();
      const auto check = checks.count(specs[i]) ? checks[specs[i]] : Check{"unchecked", 0.0};
      all_passed = all_passed && check.status != "incorrect";
      // No checkpoint row in this run: no ratio (an empty cell, never 0).
      const std::string ratio = checkpoint_seconds > 0 ? fmt::format("{:.4f}", m.median_seconds() / checkpoint_seconds) : "";
      table_lines.push_back(fmt::format("{:>6}  {:<40} {:>10} {:>10} {:>7.3f} {:>8.2f} {:>8}  {}", T, methods[i]->spec(),
                 format_bytes(m.peak_bytes), format_bytes(est), double(m.peak_bytes) / double(est), m.median_seconds(),
                 ratio.empty() ? "-" : ratio.substr(0, 5), check.status));
      std::string all;
      for (double s : m.bp_seconds) all += (all.empty() ? "" : " ") + fmt::format("{:.4f}", s);
      table.add({a.preset, methods[i]->spec(), precision, check.status, seed,
                 {objective->spec(), model.lora().enabled() ? model.lora().spec() : "", std::to_string(a.batch_size), std::to_string(T), std::to_string(m.peak_bytes),
                  std::to_string(est), fmt::format("{:.4f}", double(m.peak_bytes) / double(est)),
                  fmt::format("{:.4f}", m.median_seconds()), all, ratio,
                  check.status == "unchecked" ? "" : fmt::format("{:.3e}", check.max_normwise_rel),
                  // The check ran at its own size: say which, so `passed` is never read as "checked at this T".
                  check.status == "unchecked" ? "" : std::to_string(a.check_seq_len),
                  check.status == "unchecked" ? "" : std::to_string(a.batch_size),
                  check.status == "unchecked" ? "" : "fp64"}});
    }
  }
  const auto csv = table.write(a.out_dir, "demo", collect_provenance(command_line));
  fmt::print("\n");
  for (const auto& line : table_lines) fmt::print("{}\n", line);
  fmt::print("\nresults: {} (BP s = median of {}; vs ckpt = ratio of medians in this run)\n", csv.string(), a.repeats);
  return all_passed ? 0 : 1;
}

}  // namespace sbp
