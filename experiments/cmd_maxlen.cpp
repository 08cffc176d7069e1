// `streambp maxlen`: the maximum sequence length of each BP method under a byte budget (the paper's Table 3 and
// Fig. 4). The analytic memory model predicts it (the largest T whose model peak fits); measurement confirms it: a
// run at T that completes under the budget and one at the next step up (T · (1 + step)) that exceeds it, both
// recorded, starting from the prediction and walking up or down by the step. The CPU meter enforces the budget like a
// full GPU would (c10::OutOfMemoryError), so an over-budget run costs at most its time up to that allocation.
#include <chrono>
#include <cmath>
#include <cstdio>

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "baselines/methods.h"
#include "core/io/dtype.h"
#include "experiments/commands.h"
#include "experiments/results_table.h"

namespace sbp {

void add_maxlen_options(CLI::App& app, MaxlenArgs& a) {
  app.add_option("--preset", a.source.preset, "model preset (default qwen3-small unless --config)");
  app.add_option("--config", a.source.config_file, "HF config.json: random weights of that shape")->check(CLI::ExistingFile);
  app.add_option("--budget-bytes", a.budget_bytes, "the memory budget (bytes of tensors, as the CPU meter counts them)")
      ->required()->check(CLI::PositiveNumber);
  app.add_option("--methods", a.methods, "semicolon-separated method specs");
  app.add_option("--objective", a.objective, "objective spec (sft, grpo:..., dpo:...; see run --help)");
  app.add_option("--lora", a.lora, "LoRA spec for every method (see run --help)");
  app.add_option("--dtype", a.dtype, "fp64, fp32 or bf16")->check(CLI::IsMember({"fp32", "bf16", "fp64"}));
  app.add_option("--grad-dtype", a.grad_dtype, "fp32 with --dtype bf16: mixed precision (see run --help)")->check(CLI::IsMember({"fp32", "bf16", "fp64"}));
  app.add_option("--batch", a.batch_size, "rows per batch (DPO: chosen + rejected, even)")->check(CLI::PositiveNumber);
  app.add_option("--group", a.group, "GRPO: completions per prompt (default: the whole batch)")->check(CLI::PositiveNumber);
  app.add_option("--step", a.step, "resolution: the failing run is at T * (1 + step)")->check(CLI::Range(0.001, 1.0));
  app.add_option("--max-seq", a.max_seq, "upper end of the search")->check(CLI::Range(std::int64_t(16), std::int64_t(1) << 30));
  app.add_option("--threads", a.threads, "intra-op threads (default: torch's)")->check(CLI::NonNegativeNumber);
  app.add_option("--out", a.out_dir, "results folder");
  add_device_option(app, a.device);
  app.add_flag("--model-only", a.model_only, "print the model's predictions and stop (no measurement, no file)");
}

int maxlen_command(const MaxlenArgs& a, const std::string& command_line) {
  if (a.threads > 0) at::set_num_threads(a.threads);
  const ModelSource source = a.source.or_preset("qwen3-small");
  const auto device = parse_device(a.device);
  const auto dtype = parse_dtype(a.dtype);
  const std::uint64_t seed = 0;
  auto objective = make_objective(a.objective);
  auto model = build_trained_model(source, dtype, a.lora, a.grad_dtype, seed, device);
  const auto precision = precision_name(model->dtype(), model->grad_dtype());
  const auto batch_at = [&](std::int64_t T) {
    return prepared_random_batch(*model, *objective, a.batch_size, T, a.group, seed);
  };
  // The memory model needs the prepared objective's per-token buffers, which do not depend on T: one small batch.
  const auto workload_at = [&, base = make_workload(*model, *objective, batch_at(16))](std::int64_t T) {
    auto w = base;
    w.seq_len = T;
    return w;
  };

  ResultsTable table({"objective", "lora", "batch_size", "seq_len", "budget_bytes", "role", "peak_bytes",
                      "model_peak_bytes", "bp_seconds", "model_max_seq", "measured_max_seq", "model_error"});
  const auto prov = collect_provenance(command_line, describe_device(device));
  if (!a.model_only) std::filesystem::create_directories(a.out_dir);
  const auto csv = ResultsTable::new_path(a.out_dir, "maxlen", prov);
  std::vector<std::string> summary;
  const auto started = std::chrono::steady_clock::now();
  for (const auto& spec_text : split_list(a.methods, ';')) {
    auto method = make_method(spec_text);
    const auto spec = method->spec();
    const auto model_peak = [&](std::int64_t T) { return method->memory_model(workload_at(T)).total_bytes(); };
    // The model's answer: the largest T in [2, max_seq] whose modelled peak fits (the model grows with T).
    std::int64_t lo = 2, hi = a.max_seq;
    if (model_peak(lo) > a.budget_bytes) lo = 1;  // not even T = 2 fits
    else if (model_peak(hi) <= a.budget_bytes) lo = hi;
    else
      while (hi - lo > 1) {
        const auto mid = lo + (hi - lo) / 2;
        (model_peak(mid) <= a.budget_bytes ? lo : hi) = mid;
      }
    const auto predicted = lo;
    fmt::print(stderr, "{}: the model predicts T* = {} under {}\n", spec, predicted, format_bytes(a.budget_bytes));
    if (a.model_only) continue;
    struct Probe {
      std::int64_t T;
      Measurement m;
    };
    std::vector<Probe> probes;
    auto probe = [&](std::int64_t T) {
      const auto batch = batch_at(T);
      auto m = measure_method(*model, *method, *objective, batch, 0, 1, a.budget_bytes);
      if (m.status == "error") throw std::runtime_error(spec + " at T = " + std::to_string(T) + ": " + m.error);
      const auto elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      fmt::print(stderr, "  {} T={:<8} {}  (elapsed {:.0f} s)\n", spec, T,
                 m.status == "oom" ? std::string("over the budget")
                                   : fmt::format("fits: peak {} in {:.2f} s", format_bytes(m.peak_bytes), m.bp_seconds.at(0)),
                 elapsed);
      probes.push_back({T, m});
      return m.status == "passed";
    };
    const auto up = [&](std::int64_t T) { return std::max(T + 1, std::int64_t(std::ceil(double(T) * (1 + a.step)))); };
    const auto down = [&](std::int64_t T) { return std::min(T - 1, std::int64_t(std::floor(double(T) / (1 + a.step)))); };
    std::int64_t fits = 0, fails = 0;  // the largest T measured to fit, and the T one step above it that did not
    if (const auto T = std::max<std::int64_t>(predicted, 2); probe(T)) {
      fits = T;
      while (fits < a.max_seq && probe(up(fits))) fits = up(fits);
      fails = fits < a.max_seq ? up(fits) : 0;
    } else {
      fails = T;
      for (auto t = down(T); t >= 2; t = down(t)) {
        if (probe(t)) {
          fits = t;
          break;
        }
        fails = t;
      }
    }
    const std::string measured = fits > 0 ? std::to_string(fits) : "";
    const std::string error = fits > 0 ? fmt::format("{:.4f}", double(predicted) / double(fits) - 1.0) : "";
    for (const auto& p : probes) {
      const bool oom = p.m.status == "oom";
      const std::string role = p.T == fits ? "max" : p.T == fails ? "next" : "probe";
      table.add({source.describe(), spec, precision, oom ? "oom" : "unchecked", seed,
                 {objective->spec(), model->lora().enabled() ? model->lora().spec() : "", std::to_string(a.batch_size),
                  std::to_string(p.T), std::to_string(a.budget_bytes), role, oom ? "" : std::to_string(p.m.peak_bytes),
                  std::to_string(model_peak(p.T)), oom ? "" : fmt::format("{:.4f}", p.m.median_seconds()),
                  std::to_string(predicted), measured, error}});
    }
    table.write_to(csv, prov);  // after every method: a killed search keeps the methods it finished
    summary.push_back(fmt::format("{:<44} model T* = {:>8}   measured T* = {:>8} (T = {} over the budget)   model error {}",
                                  spec, predicted, measured.empty() ? "-" : measured, fails > 0 ? std::to_string(fails) : "-",
                                  error.empty() ? "-" : error));
  }
  if (a.model_only) return 0;
  fmt::print("\nmaximum T under {} ({}, {}, B = {}):\n", format_bytes(a.budget_bytes), precision, objective->spec(), a.batch_size);
  for (const auto& line : summary) fmt::print("  {}\n", line);
  fmt::print("\nresults: {}\n", csv.string());
  return 0;
}

}  // namespace sbp
