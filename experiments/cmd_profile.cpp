// `streambp profile`: the memory timeline of consecutive forward + backward steps (the paper's Fig. 1 and 8), per
// method: every allocation and free from the CPU meter, with the phase it happened in and a category
// (profiler/memory_categories.h), as a CSV and a Chrome trace (Perfetto), plus a summary row per method.
#include <sstream>

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "experiments/cli_checks.h"
#include "baselines/methods.h"
#include "core/io/dtype.h"
#include "core/io/safetensors.h"
#include "experiments/commands.h"
#include "experiments/exit_status.h"
#include "experiments/measure.h"
#include "experiments/memory_check.h"
#include "experiments/results_table.h"
#include "profiler/memory_categories.h"

namespace sbp {

void add_profile_options(CLI::App& app, ProfileArgs& a) {
  add_setup_options(app, a.setup, {.adapter = false, .group = false, .device = false, .default_preset = "qwen3-small"});
  add_methods_option(app, a.methods, "the methods profiled, one after the other");
  add_measure_options(app, a.measure, {});
  app.add_option("--steps", a.steps, "forward + backward steps in the timeline (the paper shows two)")->check(CLI::PositiveNumber)->capture_default_str();
  add_output_options(app, a.output, "results folder");
  app.add_flag("--no-memory-check", a.no_memory_check, "profile even a method whose modelled peak is above the memory "
               "the process may use; without it such a run stops before any step (exit 3)");
  app.footer("Categories are attributed by the phase that allocated a block and its lifetime (weights & batch: live "
             "before the first step; gradients: still alive when its step ends; checkpoints / activations: made in the "
             "forward and alive after it; K/V: StreamBP's K/V recompute; logits / head: the head phases; working set: "
             "the rest).");
}

int profile_command(const ProfileArgs& a, const std::string& command_line) {
  Setup setup = a.setup;
  setup.apply_threads();
  const auto& source = setup.source;
  const auto seed = setup.seed;
  auto objective = build_objective(setup);
  auto model = build_model(setup);
  const auto batch = prepared_random_batch(*model, *objective, a.measure.batch_size(), a.measure.seq_len(), 0, seed);
  const auto workload = make_workload(*model, objective->prepare(batch, model->config()), batch);
  // Every method's modelled peak against what the process may use, before any step (experiments/memory_check.h): a
  // method that cannot fit stops the run in seconds, not after the methods before it.
  if (!a.no_memory_check)
    for (const auto& spec_text : a.methods) {
      const auto method = make_method(spec_text);
      const auto check = check_workload_memory([&](const Workload& w) { return method->memory_model(w); }, workload,
                                               a.measure.budget_bytes, /*cpu=*/true, model_weight_bytes(*model));
      if (!check.fits()) {
        fmt::print(stderr, "streambp: out of memory: not run: {}: {} (--no-memory-check profiles anyway)\n",
                   method->spec(), memory_shortfall(check, workload.batch_size));
        return kExitOutOfMemory;
      }
    }

  std::vector<std::string> columns = {"objective", "lora", "batch_size", "seq_len", "steps", "peak_bytes",
                                      "model_peak_bytes", "timeline"};
  for (const auto* c : kMemoryCategories) columns.push_back(std::string("at_peak: ") + c);
  ResultsTable table(columns);
  const auto prov = collect_provenance(command_line);
  std::filesystem::create_directories(a.output.out_dir);
  const auto csv = ResultsTable::new_path(a.output.out_dir, "profile", prov);
  const auto stem = csv.stem().string();
  auto& meter = CpuMemoryMeter::install();
  for (const auto& spec_text : a.methods) {
    auto method = make_method(spec_text);
    const auto spec = method->spec();
    model->zero_grad();
    meter.reset_peak();
    const auto before = meter.current_bytes();
    meter.start_timeline();
    std::vector<std::size_t> step_ends;
    for (int s = 0; s < a.steps; ++s) {
      method->step(*model, *objective, batch);
      step_ends.push_back(meter.timeline_size());
      fmt::print(stderr, "  {} step {}/{} done\n", spec, s + 1, a.steps);
    }
    const auto events = categorize_timeline(meter.stop_timeline(), before, step_ends);
    model->zero_grad();
    // The moment of the peak and what it held.
    const auto peak = std::max_element(events.begin(), events.end(), [](const auto& x, const auto& y) {
      return x.current_bytes < y.current_bytes;
    });
    const auto name = spec.substr(0, spec.find(':'));
    const auto timeline = stem + "-" + name;
    std::ostringstream csv_text, trace_text;
    write_categorized_csv(events, csv_text);
    write_categorized_chrome_trace(events, trace_text);
    write_file_atomically(std::filesystem::path(a.output.out_dir) / (timeline + ".timeline.csv"), csv_text.str());
    write_file_atomically(std::filesystem::path(a.output.out_dir) / (timeline + ".trace.json"), trace_text.str());
    std::vector<std::string> values = {objective->spec(), model->lora().enabled() ? model->lora().spec() : "",
                                       std::to_string(a.measure.batch_size()), std::to_string(a.measure.seq_len()), std::to_string(a.steps),
                                       std::to_string(peak->current_bytes),
                                       std::to_string(method->memory_model(workload).total_bytes()), timeline};
    fmt::print("{:<44} peak {} at {:.2f} s (phase {}):", spec, format_bytes(peak->current_bytes), peak->seconds, peak->phase);
    for (std::size_t c = 0; c < kMemoryCategories.size(); ++c) {
      values.push_back(std::to_string(peak->live[c]));
      fmt::print("  {} {}", kMemoryCategories[c], format_bytes(peak->live[c]));
    }
    fmt::print("\n");
    table.add({source.describe(), spec, dtype_name(model->dtype()), check_status_name(CheckStatus::unchecked), seed,
               values});
    table.write_to(csv, prov);
  }
  fmt::print("results: {} (timelines: {}-<method>.timeline.csv / .trace.json; the stacked figure: `make plots`, "
             "into figures/)\n", std::filesystem::absolute(csv).string(), stem);
  return 0;
}

}  // namespace sbp
