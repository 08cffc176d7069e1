// `streambp demo`: the headline side-by-side, a sequence sweep (cmd_sweep.cpp) on a built-in default. For each
// sequence length and BP method: measured peak memory, its analytic model, BP time (median of repeats, methods
// interleaved in one run, reported as a ratio to checkpoint) and the method's gradient check (fp64, every parameter
// against standard BP).

#include <CLI/CLI.hpp>

#include "experiments/commands.h"

namespace sbp {

void add_demo_options(CLI::App& app, DemoArgs& a) {
  add_setup_options(app, a.setup, {.load = false, .adapter = false, .default_preset = "qwen3-small"});
  add_methods_option(app, a.methods, "the methods side by side");
  add_measure_options(app, a.measure, {.seq = Arity::many, .repeats = true, .check_seq = true});
  add_output_options(app, a.output, "results folder");
}

int demo_command(const DemoArgs& a, const std::string& command_line) {
  SweepPlan plan;
  plan.setup = a.setup;
  plan.methods = a.methods;
  plan.seq_lens = a.measure.seq_lens, plan.batch_sizes = a.measure.batch_sizes;
  plan.check_seq_len = a.measure.check_seq_len, plan.repeats = a.measure.repeats;
  plan.out_dir = a.output.out_dir, plan.stem = "demo";
  return run_sweep(plan, command_line);
}

}  // namespace sbp
