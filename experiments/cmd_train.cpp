// `streambp train`: optimizer steps of any BP method (core/training/trainer.h), with gradient accumulation, a data folder or
// seeded random batches, atomic resumable checkpoints, a per-step metrics CSV and a progress line per step. Here: the
// flags and what they mean together, checked before any rank starts; each rank's run is a TrainSession
// (experiments/train_session.h).
#include <algorithm>
#include <filesystem>
#include <fstream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/io/input_error.h"
#include "core/training/trainer.h"
#include "experiments/commands.h"
#include "experiments/launch.h"
#include "experiments/train_session.h"

namespace sbp {

namespace fs = std::filesystem;

void add_train_options(CLI::App& app, TrainArgs& a) {
  add_model_options(app, a.run);
  if (auto* device = app.get_option_no_throw("--device"))
    device->description(device->get_description() + "; data-parallel (--nproc, torchrun): rank r on cuda:(its local "
                        "rank mod the GPU count), N ignored, NCCL between them");
  app.add_option("--steps", a.steps, "optimizer steps of the whole run (a resumed run counts the steps already taken; a larger value extends a "
                 "finished run whose schedule is constant)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  add_optimizer_options(app, a.optimizer, "the update of every step");
  app.add_option("--lr-schedule", a.lr_schedule, "constant|cosine[,warmup=K]: HF's get_constant/cosine_schedule_with_"
                 "warmup over --steps")->capture_default_str();
  app.add_option("--clip-grad-norm", a.clip_grad_norm, "clip the global gradient 2-norm to X as torch.nn.utils."
                 "clip_grad_norm_ (0: off; the norm is reported either way)")->check(CLI::NonNegativeNumber);
  app.add_option("--grad-accum", a.grad_accum, "micro-batches per step: each global batch is split by rows into K "
                 "(normalised by the step's total target count, HF/TRL's num_items_in_batch)")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--micro-batches", a.micro_batches, "each step's micro-batches by rows of its global batch, e.g. "
                 "\"0;1,2;3\" (';' between micro-batches; DPO: a micro-batch is its chosen rows, then their rejected "
                 "rows); uneven ones allowed, normalised as --grad-accum's; one data-parallel group (--nproc = --sp)");
  app.add_option("--save-grads", a.run.save_grads, "write the last step's gradients as its update read them (summed "
                 "over ranks, after clipping; safetensors, HF names, PEFT names under LoRA); ZeRO 0-1, no gradient or "
                 "parameter offload");
  app.add_flag("--no-memory-check", a.no_memory_check, "train even when the model's peak of a step is above the "
               "memory the process may use (the cgroup's limit, ulimit -v, MemAvailable); without it such a run stops "
               "before its first step (exit 3), naming the longest T that fits");
  app.add_option("--data", a.data_dir, "folder of batch files (safetensors, as --save-batch writes them), one global "
                 "batch per step in lexical order, cycled; default: a seeded random batch per step (--batch, --seq)")
      ->check(CLI::ExistingDirectory);
  app.add_option("--save-every", a.save_every, "write a resumable checkpoint every K steps (and after the last) into "
                 "--checkpoint-dir; 0: none but the one a Ctrl-C writes")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--checkpoint-dir", a.checkpoint_dir, "folder of the resumable checkpoints (checkpoint-NNNNNN)");
  app.add_option("--resume", a.resume_dir, "continue from the latest complete checkpoint in DIR (from step 0 when it "
                 "has none); checkpoints then also go there unless --checkpoint-dir says otherwise");
  add_rank_options(app, a.ranks, "each back-propagating its rows of every global batch");
  add_sequence_parallel_option(app, a.ranks);
  app.add_option("--metrics", a.metrics, "per-step CSV (loss, grad norm, lr, tokens, BP and optimizer seconds, peak "
                 "bytes) and its JSON sidecar with provenance, named as the CSV with the extension .json (run.csv: "
                 "run.json, so not --json's name); a resumed run keeps the rows up to its checkpoint");
}

namespace {

// The step the latest complete checkpoint in `dir` reached (0 without one, or when its trainer.json does not read:
// loading it later reports why).
std::int64_t checkpoint_step(const fs::path& dir) {
  const auto latest = Trainer::latest_checkpoint(dir);
  if (latest.empty()) return 0;
  std::ifstream in(latest / "trainer.json");
  const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  return j.is_object() && j.contains("step") && j["step"].is_number_integer() ? j["step"].get<std::int64_t>() : 0;
}

// What the flags mean together, checked before any rank starts (once, not once per rank): a mistake is one message,
// not one per rank, and a run that cannot be resumed or split is refused before it takes a step.
TrainPlan plan_train(const TrainArgs& a) {
  // A mistyped --resume folder must not quietly become a fresh run from step 0.
  if (!a.resume_dir.empty() && !fs::is_directory(a.resume_dir))
    throw InputError("--resume " + a.resume_dir + ": no such folder (a mistyped path?); a fresh run that "
                                "checkpoints there is --checkpoint-dir " + a.resume_dir + " --save-every N");
  const auto& r = a.run;
  TrainPlan plan;
  plan.checkpoint_dir = !a.checkpoint_dir.empty() ? a.checkpoint_dir : a.resume_dir;
  // Every output at once: two on one path would overwrite each other (the metrics' sidecar once overwrote --json's
  // record of the same name).
  check_distinct_outputs({{"--json", r.json},
                          {"--save-grads", r.save_grads},
                          {"--save-model", r.save_model},
                          {"--save-adapter", r.save_adapter},
                          {"--metrics", a.metrics},
                          {"--metrics (its .json sidecar)", metrics_sidecar(a.metrics)},
                          {a.checkpoint_dir.empty() ? "--resume" : "--checkpoint-dir", plan.checkpoint_dir}});
  // A finished run resumed (docs/training.md's recipe after the end) takes no step: the outputs it wrote stay as they are,
  // and one it did not write (a new --save-model) is written from its final checkpoint once the trajectory is checked
  // (a changed setting is refused as on any resume). Its metrics are only in the file its steps wrote.
  plan.taken = a.resume_dir.empty() ? 0 : checkpoint_step(a.resume_dir);
  plan.finished = !a.resume_dir.empty() && plan.taken >= a.steps;
  const auto kept = [&plan](const std::string& path) { return plan.finished && !path.empty() && fs::exists(path); };
  plan.keep_json = kept(r.json);
  plan.keep_model = kept(r.save_model);
  plan.keep_adapter = kept(r.save_adapter);
  if (plan.finished && !r.save_grads.empty())
    throw InputError(fmt::format("--save-grads {}: the run in {} is finished (step {}, --steps {}): it takes no step "
                                 "whose gradients could be written", r.save_grads, a.resume_dir, plan.taken, a.steps));
  if (plan.finished && !a.metrics.empty() && !fs::exists(a.metrics))
    throw InputError(fmt::format("--metrics {}: the run in {} is finished (step {}, --steps {}) and the "
                                            "metrics of its steps are in the file its --metrics wrote, not in the "
                                            "checkpoints", a.metrics, a.resume_dir, plan.taken, a.steps));
  plan.env = rank_from_environment();
  const auto& env = plan.env;
  // The ranks form sequence-parallel groups, and a random global batch splits evenly over the data-parallel ones.
  if (!env)
    if (const auto problem = sequence_layout_problem(a.ranks.nproc, a.ranks.sp); !problem.empty())
      throw InputError(problem);
  const int data_parts = a.ranks.nproc / std::max(a.ranks.sp, 1);
  if (data_parts > 1 && !env && a.data_dir.empty() && a.run.measure.batch_size() % data_parts != 0)
    throw InputError(uneven_batch(data_parts, "--batch " + std::to_string(a.run.measure.batch_size()),
                                             a.run.measure.batch_size()));
  check_offload_kinds(a.run.offload, /*training=*/true, a.ranks.nproc, a.ranks.zero);
  plan.micro_rows = a.micro_batches.empty() ? MicroBatchRows{} : parse_micro_batch_rows(a.micro_batches, "--micro-batches");
  if (!plan.micro_rows.empty() && a.grad_accum != 1)
    throw InputError("--micro-batches gives each step's micro-batches: it excludes --grad-accum");
  if (!plan.micro_rows.empty() && data_parts > 1)
    throw InputError(fmt::format("--micro-batches names rows of one batch: {} data-parallel groups (--nproc {} / --sp "
                                 "{}) would each hold other rows", data_parts, a.ranks.nproc, std::max(a.ranks.sp, 1)));
  if (!r.save_grads.empty()) {
    // The gradients are whole on every rank only until ZeRO-2 shards them; offloaded ones are not the model's.
    if (a.ranks.zero >= 2) throw InputError("--save-grads needs whole gradients on rank 0: --zero 0 or 1");
    if (r.offload.gradients() || r.offload.parameters())
      throw InputError("--save-grads reads the model's gradients: not with --offload grads or params");
  }
  return plan;
}

}  // namespace

// The flags checked once, the ranks launched (each runs this again, from its environment), then this rank's session.
int train_command(const TrainArgs& a, const std::string& command_line) {
  const auto plan = plan_train(a);
  if (a.ranks.nproc > 1 && !plan.env) return launch_ranks(a.ranks.nproc);
  return run_train_session(a, plan, command_line);
}

}  // namespace sbp
