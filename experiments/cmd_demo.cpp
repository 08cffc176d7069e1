// `streambp demo`: the headline side-by-side, a sequence sweep (cmd_sweep.cpp) on a built-in default. For each
// sequence length and BP method: measured peak memory, its analytic model, BP time (median of repeats, methods
// interleaved in one run, reported as a ratio to checkpoint) and the method's gradient check (fp64, every parameter
// against standard BP).

#include <CLI/CLI.hpp>

#include "experiments/commands.h"

namespace sbp {

void add_demo_options(CLI::App& app, DemoArgs& a) {
  add_setup_options(app, a.setup, {.load = false, .adapter = false, .default_preset = "qwen3-small"});
  app.add_option("--seq", a.seq_lens, "comma-separated sequence lengths")->capture_default_str();
  app.add_option("--methods", a.methods, "semicolon-separated method specs")->capture_default_str();
  app.add_option("--batch", a.batch_size, "rows per batch (DPO: chosen + rejected, even)")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--repeats", a.repeats, "measured steps per method and length (median)")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--check-seq", a.check_seq_len, "T of the fp64 gradient check (0 = skip)")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--out", a.out_dir, "results folder")->capture_default_str();
}

int demo_command(const DemoArgs& a, const std::string& command_line) {
  SweepPlan plan;
  plan.setup = a.setup;
  plan.methods = split_list(a.methods, ';');
  plan.seq_lens = parse_sizes(a.seq_lens, "--seq"), plan.batch_sizes = {a.batch_size};
  plan.check_seq_len = a.check_seq_len, plan.repeats = a.repeats;
  plan.out_dir = a.out_dir, plan.stem = "demo";
  return run_sweep(plan, command_line);
}

}  // namespace sbp
