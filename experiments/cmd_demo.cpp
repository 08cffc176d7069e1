// `streambp demo`: the headline side-by-side, a sequence sweep (cmd_sweep.cpp) on a built-in default. For each
// sequence length and BP method: measured peak memory, its analytic model, BP time (median of repeats, methods
// interleaved in one run, reported as a ratio to checkpoint) and the method's gradient check (fp64, every parameter
// against standard BP).

#include <CLI/CLI.hpp>

#include "experiments/commands.h"

namespace sbp {

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
  add_device_option(app, a.device);
  app.add_option("--out", a.out_dir, "results folder");
}

int demo_command(const DemoArgs& a, const std::string& command_line) {
  SweepPlan plan;
  plan.source.preset = a.preset;
  plan.dtype = a.dtype, plan.grad_dtype = a.grad_dtype, plan.objective = a.objective, plan.lora = a.lora;
  plan.methods = split_list(a.methods, ';');
  plan.seq_lens = a.seq_lens, plan.batch_sizes = std::to_string(a.batch_size);
  plan.group = a.group, plan.check_seq_len = a.check_seq_len, plan.repeats = a.repeats, plan.threads = a.threads;
  plan.out_dir = a.out_dir, plan.stem = "demo", plan.device = a.device;
  return run_sweep(plan, command_line);
}

}  // namespace sbp
