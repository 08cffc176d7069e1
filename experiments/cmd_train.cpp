// `streambp train`: optimizer steps of any BP method (core/training/trainer.h), with gradient accumulation, a data folder or
// seeded random batches, atomic resumable checkpoints, a per-step metrics CSV and a progress line per step.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>

#include "baselines/methods.h"
#include "core/model/checkpoint_io.h"
#include "core/io/dtype.h"
#include "core/model/gemm.h"
#include "core/methods/memory_model.h"
#include "core/training/training_memory.h"
#include "core/io/safetensors.h"
#include "core/training/c10d_communicator.h"
#include "core/training/data_parallel.h"
#include "core/training/trainer.h"
#include "core/offload/offload_tier.h"
#include "experiments/commands.h"
#include "experiments/exit_status.h"
#include "experiments/interrupt.h"
#include "experiments/launch.h"
#include "experiments/memory_check.h"
#include "experiments/measure.h"
#include "experiments/memory_record.h"
#include "experiments/ranks.h"
#include "experiments/provenance.h"
#include "experiments/results_table.h"
#include "experiments/train_metrics.h"
#include "profiler/calibration.h"
#include "profiler/cuda_memory.h"
#include "core/io/input_error.h"

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

// --metrics FILE's JSON sidecar: FILE with the extension .json ("" without --metrics).
std::string metrics_sidecar(const std::string& metrics) {
  return metrics.empty() ? "" : fs::path(metrics).replace_extension(".json").string();
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
          {"lora", r.setup.lora},
          {"adapter", r.setup.adapter_dir},
          {"objective", objective.spec()},
          {"seed", r.setup.seed},
          {"data", a.data_dir},
          {"batch", a.data_dir.empty() ? nlohmann::json({{"B", r.measure.batch_size()}, {"T", r.measure.seq_len()}, {"pad", r.pad_fraction},
                                                          {"prompt", r.prompt_fraction}, {"group", r.setup.group}})
                                       : nlohmann::json()},
          {"ref", r.ref_dir},
          {"optimizer", optimizer},
          {"optimizer_state_dtype", a.optimizer.state_dtype},
          {"lr_schedule", a.lr_schedule},
          {"steps", a.steps},
          {"clip_grad_norm", a.clip_grad_norm},
          {"grad_accum", a.grad_accum},
          {"micro_batches", a.micro_batches}};
}

// Before the first step: the model's peak of a step against what the process may use (experiments/memory_check.h),
// so that a run that cannot fit stops in seconds instead of after its first minutes. The ranks decide together: one
// refusing alone would leave the others waiting in a collective. Returns why it does not fit ("": it does).
std::string memory_refusal(const BackpropMethod& method, const Workload& workload, const Model& model,
                           std::int64_t held_bytes, Communicator* comm) {
  const auto check = check_workload_memory([&](const Workload& w) { return training_memory(method, w); }, workload,
                                           /*budget_bytes=*/0, model.device().is_cpu(), held_bytes);
  double refused = check.fits() ? 0 : 1;
  if (comm) {
    std::vector<at::Tensor> flag = {at::full({1}, refused, at::TensorOptions(at::kFloat).device(comm->device()))};
    comm->all_reduce_sum(flag);
    refused = flag[0].item<double>();
  }
  if (refused == 0) return "";
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

// The step the latest complete checkpoint in `dir` reached (0 without one, or when its trainer.json does not read:
// loading it later reports why).
std::int64_t checkpoint_step(const fs::path& dir) {
  const auto latest = Trainer::latest_checkpoint(dir);
  if (latest.empty()) return 0;
  std::ifstream in(latest / "trainer.json");
  const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  return j.is_object() && j.contains("step") && j["step"].is_number_integer() ? j["step"].get<std::int64_t>() : 0;
}

}  // namespace

int train_command(const TrainArgs& a, const std::string& command_line) {
  // Before any rank starts: a mistyped --resume folder must not quietly become a fresh run from step 0.
  if (!a.resume_dir.empty() && !fs::is_directory(a.resume_dir))
    throw InputError("--resume " + a.resume_dir + ": no such folder (a mistyped path?); a fresh run that "
                                "checkpoints there is --checkpoint-dir " + a.resume_dir + " --save-every N");
  const auto& r = a.run;
  const auto checkpoint_dir = !a.checkpoint_dir.empty() ? a.checkpoint_dir : a.resume_dir;
  // Every output at once, before any rank starts: two on one path would overwrite each other (the metrics' sidecar
  // once overwrote --json's record of the same name).
  check_distinct_outputs({{"--json", r.json},
                          {"--save-grads", r.save_grads},
                          {"--save-model", r.save_model},
                          {"--save-adapter", r.save_adapter},
                          {"--metrics", a.metrics},
                          {"--metrics (its .json sidecar)", metrics_sidecar(a.metrics)},
                          {a.checkpoint_dir.empty() ? "--resume" : "--checkpoint-dir", checkpoint_dir}});
  // A finished run resumed (docs/training.md's recipe after the end) takes no step: the outputs it wrote stay as they are,
  // and one it did not write (a new --save-model) is written from its final checkpoint once the trajectory is checked
  // (a changed setting is refused as on any resume). Its metrics are only in the file its steps wrote.
  const std::int64_t taken = a.resume_dir.empty() ? 0 : checkpoint_step(a.resume_dir);
  const bool finished = !a.resume_dir.empty() && taken >= a.steps;
  const auto kept = [finished](const std::string& path) { return finished && !path.empty() && fs::exists(path); };
  const bool keep_json = kept(r.json), keep_model = kept(r.save_model), keep_adapter = kept(r.save_adapter);
  if (finished && !r.save_grads.empty())
    throw InputError(fmt::format("--save-grads {}: the run in {} is finished (step {}, --steps {}): it takes no step "
                                 "whose gradients could be written", r.save_grads, a.resume_dir, taken, a.steps));
  if (finished && !a.metrics.empty() && !fs::exists(a.metrics))
    throw InputError(fmt::format("--metrics {}: the run in {} is finished (step {}, --steps {}) and the "
                                            "metrics of its steps are in the file its --metrics wrote, not in the "
                                            "checkpoints", a.metrics, a.resume_dir, taken, a.steps));
  const auto env = rank_from_environment();
  // Before the ranks start (once, not once per rank): the ranks form sequence-parallel groups, and a random global
  // batch splits evenly over the data-parallel ones.
  if (!env)
    if (const auto problem = sequence_layout_problem(a.ranks.nproc, a.ranks.sp); !problem.empty())
      throw InputError(problem);
  const int data_parts = a.ranks.nproc / std::max(a.ranks.sp, 1);
  if (data_parts > 1 && !env && a.data_dir.empty() && a.run.measure.batch_size() % data_parts != 0)
    throw InputError(uneven_batch(data_parts, "--batch " + std::to_string(a.run.measure.batch_size()),
                                             a.run.measure.batch_size()));
  check_offload_kinds(a.run.offload, /*training=*/true, a.ranks.nproc, a.ranks.zero);
  const auto micro_rows = a.micro_batches.empty() ? MicroBatchRows{} : parse_micro_batch_rows(a.micro_batches, "--micro-batches");
  if (!micro_rows.empty() && a.grad_accum != 1)
    throw InputError("--micro-batches gives each step's micro-batches: it excludes --grad-accum");
  if (!micro_rows.empty() && data_parts > 1)
    throw InputError(fmt::format("--micro-batches names rows of one batch: {} data-parallel groups (--nproc {} / --sp "
                                 "{}) would each hold other rows", data_parts, a.ranks.nproc, std::max(a.ranks.sp, 1)));
  if (!r.save_grads.empty()) {
    // The gradients are whole on every rank only until ZeRO-2 shards them; offloaded ones are not the model's.
    if (a.ranks.zero >= 2) throw InputError("--save-grads needs whole gradients on rank 0: --zero 0 or 1");
    if (r.offload.gradients() || r.offload.parameters())
      throw InputError("--save-grads reads the model's gradients: not with --offload grads or params");
  }
  if (a.ranks.nproc > 1 && !env) return launch_ranks(a.ranks.nproc);
  auto ranks = join_ranks(a.ranks, env, r.setup);
  const int world = ranks.world, rank = ranks.rank;
  const auto device = ranks.device;
  const bool random = a.data_dir.empty();
  if (random && r.measure.seq_len() == 0) throw InputError("give --seq T (and --batch B) or --data DIR");
  if (!random && r.measure.seq_len() != 0) throw InputError("--seq and --data exclude each other");
  if (a.save_every > 0 && a.checkpoint_dir.empty() && a.resume_dir.empty())
    throw InputError("--save-every needs --checkpoint-dir DIR (or --resume DIR)");
  const bool writer = rank == 0;  // rank 0 writes every output; the ranks hold the same model after every step
  if (writer) {
    if (!r.json.empty() && !keep_json) check_new_output(r.json, r.force, "--json");
    if (!r.save_grads.empty()) check_new_output(r.save_grads, r.force, "--save-grads");
    if (!r.save_model.empty() && !keep_model) check_new_folder(r.save_model, r.force, "--save-model");
    if (!r.save_adapter.empty() && !keep_adapter) check_new_folder(r.save_adapter, r.force, "--save-adapter");
    if (!a.checkpoint_dir.empty())
      if (const auto why = unwritable_folder(a.checkpoint_dir); !why.empty())
        throw InputError("--checkpoint-dir " + a.checkpoint_dir + ": " + why);
  }
  // The checkpoint folder exists from the start, so that a run killed before its first checkpoint is resumed (from
  // step 0) with the same --resume as any other.
  if (writer && a.save_every > 0) fs::create_directories(checkpoint_dir);
  if (!r.save_adapter.empty() && r.setup.lora.empty() && r.setup.adapter_dir.empty())
    throw InputError("--save-adapter needs --lora or --adapter");

  TrainOptions options;
  options.optimizer = *a.optimizer.options();
  options.schedule = parse_lr_schedule(a.lr_schedule);
  options.total_steps = a.steps;
  options.grad_accum = a.grad_accum;
  options.micro_batch_rows = micro_rows;
  options.clip_grad_norm = a.clip_grad_norm;

  // Named, not a structured binding: clang before 16 cannot capture bindings in the lambdas below (sanitized build).
  RunParts parts = build_run_parts(r);
  const c10::ScalarType dtype = parts.dtype;
  std::unique_ptr<Model>& model = parts.model;
  std::unique_ptr<BackpropMethod>& method = parts.method;
  std::unique_ptr<Objective>& objective = parts.objective;
  const auto tier = make_offload(r.offload, device, *method, /*training=*/true, a.ranks.nproc, a.ranks.zero);  // its folder first
  if (r.offload.checkpoints()) method->offload_checkpoints_to(tier.get());
  if (r.offload.optimizer()) options.optimizer_tier = tier.get();
  if (r.offload.gradients()) options.gradient_tier = tier.get();
  Trainer* trainer_of_steps = nullptr;  // set once made: batch_for_step runs inside the steps
  model->to(device);
  const auto files = random ? std::vector<fs::path>{} : batch_files(a.data_dir);
  // The global batch of step s (0-based): file s mod n, or a random batch seeded by seed + s (step 0 is `run`'s
  // batch of the same seed), its log-probs completed by the current policy.
  // Data-parallel: this rank's rows of it (Objective::split: DPO keeps pairs), the same on every rank count.
  std::unique_ptr<DataParallel> parallel;
  auto batch_for_step = [&](std::int64_t s) {
    // Named as the progress lines count steps, from 1.
    const auto source = random ? fmt::format("random batch of step {}", s + 1) : files[s % files.size()].string();
    Batch batch = random ? objective->random_batch(model->config(), {r.measure.batch_size(), r.measure.seq_len(), r.pad_fraction,
                                                                     r.prompt_fraction, r.setup.seed + std::uint64_t(s), r.setup.group})
                         : read_batch_file(files[s % files.size()]);
    validate_tokens(batch, model->config(), source);
    if (ranks.data_world() > 1 && batch.batch_size() % ranks.data_world() != 0)
      throw InputError(uneven_batch(ranks.data_world(), source, batch.batch_size()));
    // A random batch's synthetic log-probs are drawn for the whole global batch (then split), so that every rank
    // count trains on the same numbers; a file's reference pass runs on this rank's rows only.
    const auto complete = [&] {
      // ZeRO-3, parameter offload: the log-probs need the whole model (every rank takes part in gathering it).
      const Trainer::WholeModel whole(*trainer_of_steps);
      complete_batch(*model, *objective, batch, source, random, r.ref_dir, dtype, r.setup.seed + std::uint64_t(s));
    };
    batch = batch.to(device);
    if (random) complete();
    if (ranks.data_world() > 1)
      batch = objective->split(batch, ranks.data_world(), source).at(std::size_t(ranks.data_rank()));
    if (!random) complete();
    return std::pair{batch, source};
  };

  const auto fingerprint = trajectory_fingerprint(a, *model, *objective, optimizer_spec(options.optimizer));
  Communicator* comm = ranks.comm.get();
  if (comm) {
    check_ranks_agree(*comm, fingerprint, method->spec());
    parallel = std::make_unique<DataParallel>(*comm, ranks.zero, r.offload.parameters() ? tier.get() : nullptr);
  }
  if (r.offload.parameters() && !parallel) options.parameter_tier = tier.get();  // on ranks: DataParallel's
  options.sequence_group = ranks.sequence.get();
  Trainer trainer(*model, *method, *objective, options, parallel.get());
  trainer_of_steps = &trainer;
  std::int64_t start_step = 0;
  if (!a.resume_dir.empty()) {
    const auto latest = Trainer::latest_checkpoint(a.resume_dir);
    if (latest.empty()) {
      fmt::print(stderr, "resume    {}: no complete checkpoint, starting at step 0\n", a.resume_dir);
    } else {
      const auto run = trainer.load_checkpoint(latest);
      const auto& saved = run.at("trajectory");
      for (const auto& [key, value] : fingerprint.items()) {
        if (saved.contains(key) && saved.at(key) == value) continue;
        // A longer --steps extends the run where the learning rates already taken do not depend on the total (the
        // constant schedule, with or without warmup); cosine decays over --steps: say why it cannot.
        if (key == "steps" && saved.contains(key) && saved.at(key).is_number_integer() &&
            a.steps > saved.at(key).get<std::int64_t>()) {
          const auto saved_steps = saved.at(key).get<std::int64_t>();
          if (options.schedule.kind != "constant")
            throw InputError(fmt::format(
                "{}: the run was written for --steps {}, this one asks {}: the {} schedule decays over --steps, so the "
                "learning rates of the steps already taken belong to a {}-step run and a longer one is another "
                "trajectory. Resume with --steps {}, or start a new run from its weights (--save-model DIR, then "
                "--load DIR)", latest.string(), saved_steps, a.steps, options.schedule.kind, saved_steps, saved_steps));
          if (writer)
            fmt::print(stderr, "extend    the run was written for --steps {}; it trains on to {} (its {} schedule does "
                               "not depend on --steps, so the steps taken are those of a {}-step run)\n",
                       saved_steps, a.steps, options.schedule.kind, a.steps);
          continue;
        }
        throw InputError(latest.string() + ": the checkpoint's " + key + " is " +
                                    (saved.contains(key) ? saved.at(key).dump() : "missing") + ", this run's " +
                                    value.dump() + " (resume with the arguments of the run that wrote it)");
      }
      start_step = trainer.steps_taken();
      fmt::print(stderr, "resume    {} (step {})\n", latest.string(), start_step);
      // The checkpoint's bf16 GEMM paths are kept (the run continues bitwise), also where this machine would take
      // the other path: say so, as the native path can be far slower on a CPU without bf16 kernels.
      if (writer && !gemm_paths_reason(model->dtype()).empty()) {
        const auto [here, why] = machine_gemm_paths(model->dtype());
        if (gemm_paths(model->dtype()).describe() != here.describe())
          fmt::print(stderr, "note      the checkpoint's {} GEMM paths ({}) are kept so that the run continues "
                             "bitwise; this machine's own would be {} ({})\n", dtype_name(model->dtype()),
                     gemm_paths(model->dtype()).describe(), here.describe(), why);
      }
    }
  }

  std::vector<std::string> metric_rows;
  if (!a.metrics.empty() && writer) {
    if (fs::exists(a.metrics) && start_step > 0 && !r.force) {
      metric_rows = read_metrics_rows(a.metrics, metrics_header(), start_step);
    } else {
      const bool replace = r.force || (start_step == 0 && !a.resume_dir.empty());
      check_new_output(a.metrics, replace, "--metrics");
      check_new_output(metrics_sidecar(a.metrics), replace, "--metrics (its .json sidecar)");
    }
  }
  const auto prov = collect_provenance(command_line, describe_device(device));
  auto write_metrics = [&] {
    if (a.metrics.empty() || !writer) return;
    std::ostringstream csv;
    csv << metrics_header() << "\n";
    for (const auto& row : metric_rows) csv << row << "\n";
    write_file_atomically(a.metrics, csv.str());
    const nlohmann::json sidecar = {{"provenance", to_json(prov)},
                                    {"method", method->spec()},
                                    {"trajectory", fingerprint},
                                    {"narrow_gemm", narrow_gemm_json()},
                                    {"columns", metrics_header()},
                                    {"peak_bytes", "live tensor bytes at the step's peak (CPU allocator meter): "
                                                   "weights, optimizer states and what the step allocates, as `run` "
                                                   "counts (not the batch); empty on CUDA"}};
    write_file_atomically(metrics_sidecar(a.metrics), sidecar.dump(2) + "\n");
  };

  if (writer && finished)
    fmt::print(stderr, "train     nothing to do: {} holds step {} and --steps is {}, so the run is finished and the "
                       "outputs it wrote stay as they are; a larger --steps trains on (with a constant schedule)\n",
               a.resume_dir, start_step, a.steps);
  else if (writer)
    fmt::print(stderr, "train     {} on {} ({}), {} {}, steps {}..{} of {}{}\n", method->spec(), r.setup.source.describe(),
               precision_name(model->dtype(), model->grad_dtype()), optimizer_spec(options.optimizer),
               lr_schedule_spec(options.schedule), start_step + 1, a.steps, a.steps,
               ranks.describe());
  if (writer)
    for (const auto& [dtype, choice] : chosen_gemm_paths())
      fmt::print(stderr, "kernels   {} GEMMs {} ({})\n", dtype, choice.first, choice.second);
  if (writer && random && !finished)
    fmt::print(stderr, "data      random batches (no --data): fresh random tokens every step, so the loss shows the "
                       "method at work, not learning; --data DIR trains on batch files (--save-batch writes them)\n");
  auto& meter = CpuMemoryMeter::install();
  const bool metered = !device.is_cuda();
  const auto weight_bytes = model_weight_bytes(*model);
  std::optional<MemoryEstimate> estimate;  // of the first step's micro-batch shape
  double total_seconds = 0, last_loss = 0, first_loss = 0;
  std::int64_t total_tokens = 0;
  std::int64_t peak = 0;
  const auto run_start = std::chrono::steady_clock::now();
  std::int64_t last_saved_step = -1;
  const auto save = [&](std::int64_t step) {
    const auto dir = trainer.save_checkpoint(checkpoint_dir, {{"trajectory", fingerprint},
                                                              {"method", method->spec()},
                                                              {"provenance", to_json(prov)}});
    last_saved_step = step;
    if (writer) fmt::print(stderr, "checkpoint {}\n", dir.string());
  };
  // After a step: stop when a Ctrl-C arrived on any rank (all of them agree, or one would wait in the next step's
  // collectives forever), with a checkpoint of this step where there is a folder for it and the command that resumes.
  const auto stop_after_step = [&](std::int64_t step) {
    bool stop = interrupted();
    if (comm) {
      std::vector<at::Tensor> flag = {at::full({1}, stop ? 1.0 : 0.0, at::TensorOptions(at::kFloat).device(comm->device()))};
      comm->all_reduce_sum(flag);
      stop = flag[0].item<double>() > 0;
    }
    if (!stop) return false;
    if (!checkpoint_dir.empty() && last_saved_step != step) save(step);
    if (writer) {
      if (checkpoint_dir.empty())
        fmt::print(stderr, "stopped   after step {} of {} (Ctrl-C); no checkpoint: a run that can be resumed needs "
                           "--checkpoint-dir DIR --save-every K\n", step, a.steps);
      else
        fmt::print(stderr, "stopped   after step {} of {} (Ctrl-C); resume with:\n  {}\n", step, a.steps,
                   command_line.find(" --resume ") != std::string::npos
                       ? command_line
                       : command_line + " --resume " + shell_quote(checkpoint_dir));
    }
    return true;
  };
  watch_interrupts("\ninterrupt: stopping after this step to write a checkpoint (Ctrl-C again to stop now)\n");
  for (std::int64_t s = start_step; s < a.steps; ++s) {
    const auto [batch, source] = batch_for_step(s);
    if (!estimate) {
      const auto micro = trainer.micro_batches(batch, source);
      objective->prepare(micro.front(), model->config(), source);
      auto workload = make_workload(*model, *objective, micro.front());
      trainer.add_optimizer_memory(workload);
      workload.accumulating = micro.size() > 1;
      workload.offload_checkpoints = r.offload.checkpoints();
      workload.offload_optimizer = r.offload.optimizer();
      workload.offload_gradients = r.offload.gradients();
      workload.offload_parameters = r.offload.parameters();
      workload.sequence_parallel = ranks.sp;
      estimate = training_memory(*method, workload);
      if (!a.no_memory_check) {
        if (const auto why = memory_refusal(*method, workload, *model, weight_bytes + trainer.held_bytes(), comm);
            !why.empty()) {
          if (writer)
            fmt::print(stderr, "streambp: out of memory: not run: {} (--no-memory-check trains anyway)\n", why);
          return kExitOutOfMemory;
        }
      }
    }
    model->zero_grad();  // the previous step's gradients are not part of this step
    meter.reset_peak();
    // As `run` counts: the step's peak with the model's weights and the optimizer's states, not what else the
    // process holds (the batch, the data's files).
    const auto held = meter.current_bytes() - weight_bytes - trainer.held_bytes();
    if (comm) comm->reset_stats();
    if (ranks.sequence) ranks.sequence->reset_stats();
    const auto t = trainer.step(batch, source);
    const auto stats_of = [](const Communicator* c, const char* kind) {
      return c && c->stats().count(kind) ? c->stats().at(kind) : CollectiveStats{};
    };
    const auto reduced = stats_of(comm, "all_reduce"), scattered = stats_of(comm, "reduce_scatter"),
               gathered = stats_of(comm, "all_gather");
    const Communicator* group = ranks.sequence.get();
    const auto sp_gathered = stats_of(group, "all_gather"), sp_scattered = stats_of(group, "reduce_scatter"),
               sp_reduced = stats_of(group, "all_reduce");
    const auto step_peak = meter.peak_bytes() - held;
    peak = std::max(peak, step_peak);
    if (s == start_step) first_loss = t.loss;
    last_loss = t.loss;
    total_tokens += t.tokens;
    total_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
    const double per_step = total_seconds / double(s + 1 - start_step);
    if (writer)
      fmt::print(stderr, "step {}/{}  loss {:.6g}  grad_norm {:.4g}  lr {:.4g}  {:.0f} tok/s  peak {}  ETA {}\n", t.step,
               a.steps, t.loss, t.grad_norm, t.lr, double(t.tokens) / (t.bp_seconds + t.optimizer_seconds),
               metered ? format_bytes(step_peak) : "-", eta_text(per_step * double(a.steps - t.step)));
    metric_rows.push_back(metrics_row({.step = t,
                                       .peak_bytes = metered ? std::optional(step_peak) : std::nullopt,
                                       .world_size = world,
                                       .zero = ranks.zero,
                                       .sp = ranks.sp,
                                       .all_reduce = reduced,
                                       .reduce_scatter = scattered,
                                       .all_gather = gathered,
                                       .sp_all_gather = sp_gathered,
                                       .sp_reduce_scatter = sp_scattered,
                                       .sp_all_reduce = sp_reduced}));
    write_metrics();
    const bool last = t.step == a.steps;
    // Every rank takes part (ZeRO gathers its slices into whole tensors); rank 0 writes.
    if (!checkpoint_dir.empty() && ((a.save_every > 0 && t.step % a.save_every == 0) || (last && a.save_every > 0))) {
      save(t.step);
    }
    if (!last && stop_after_step(t.step)) return kInterruptedExit;
  }
  // Data-parallel: the model is of one rank (rank 0's slices, the longest), printed beside rank 0's peak; every
  // rank's is in the JSON.
  if (writer && estimate && metered && trainer.steps_taken() > start_step)
    fmt::print(stderr, "peak      {}{} measured, {} analytic{} ({:+.1f}%, peak at {})\n", world > 1 ? "rank 0: " : "",
               format_bytes(peak), format_bytes(estimate->total_bytes()),
               world > 1 ? fmt::format(" per rank of {} ({})", world, ranks.zero == 0 ? "DDP" : fmt::format("ZeRO-{}", ranks.zero)) : "",
               100.0 * (double(peak) / double(estimate->total_bytes()) - 1.0), estimate->moment);
  if (writer && tier && estimate && trainer.steps_taken() > start_step)
    fmt::print(stderr, "offload   {} in {}: {} held at the tier's peak, {} analytic\n", r.offload.describe(),
               tier->describe(), format_bytes(tier->peak_bytes()), format_bytes(estimate->host_bytes()));
  // Every rank's peak (also a barrier: every rank finished its steps before rank 0 reports).
  std::vector<std::int64_t> rank_peaks = {peak};
  if (comm) {
    const auto all = comm->all_gather(at::tensor(std::vector<std::int64_t>{peak},
                                                 at::TensorOptions(at::kLong).device(comm->device()))).cpu();
    rank_peaks.assign(all.data_ptr<std::int64_t>(), all.data_ptr<std::int64_t>() + all.numel());
  }
  // ZeRO-3, parameter offload: the final model is whole (on every rank) before rank 0 writes it.
  const Trainer::WholeModel whole(trainer);
  if (!writer) return 0;
  if (world > 1 && metered && trainer.steps_taken() > start_step) {
    std::string list;
    for (std::size_t q = 0; q < rank_peaks.size(); ++q)
      list += fmt::format("{}rank {} {}", q ? ", " : "", q, format_bytes(rank_peaks[q]));
    fmt::print(stderr, "peak      per rank: {}\n", list);
  }
  // The last step's gradients are still the model's: the next step would zero them.
  if (writer && !r.save_grads.empty() && trainer.steps_taken() > start_step)
    save_gradients(*model, r.save_grads, {{"method", method->spec()},
                                          {"dtype", precision_name(model->dtype(), model->grad_dtype())},
                                          {"commit", prov.commit}, {"command", prov.command}});
  if (!r.save_model.empty() && !keep_model) save_model_dir(*model, r.save_model);
  if (!r.save_adapter.empty() && !keep_adapter) save_adapter_dir(*model, r.save_adapter, r.setup.source.describe());
  if (!r.json.empty() && !keep_json) {
    const nlohmann::json j = {{"status", "completed"},
                              {"steps", trainer.steps_taken()},
                              {"start_step", start_step},
                              {"final_loss", trainer.steps_taken() > start_step ? nlohmann::json(last_loss) : nlohmann::json()},
                              {"seconds", total_seconds},
                              {"peak_bytes", metered && trainer.steps_taken() > start_step ? nlohmann::json(peak) : nlohmann::json()},
                              {"model_peak_bytes", estimate ? nlohmann::json(estimate->total_bytes()) : nlohmann::json()},
                              {"model_peak_moment", estimate ? nlohmann::json(estimate->moment) : nlohmann::json()},
                              {"model_terms", estimate ? terms_json(estimate->terms) : nlohmann::json()},
                              {"optimizer_state_bytes", trainer.optimizer().state_bytes()},
                              {"offload", r.offload.describe()},
                              {"host_peak_bytes", tier ? nlohmann::json(tier->peak_bytes()) : nlohmann::json()},
                              {"model_host_bytes", tier && estimate ? nlohmann::json(estimate->host_bytes()) : nlohmann::json()},
                              {"method", method->spec()},
                              {"world_size", world},
                              {"zero", ranks.zero},
                              {"rank_peak_bytes", metered && trainer.steps_taken() > start_step ? nlohmann::json(rank_peaks)
                                                                                                 : nlohmann::json()},
                              {"trajectory", fingerprint},
                              {"narrow_gemm", narrow_gemm_json()},
                              {"metrics", a.metrics},
                              {"device", describe_device(device)},
                              {"provenance", to_json(prov)}};
    write_file_atomically(r.json, j.dump(2) + "\n");
  }
  // The end, in a few lines: what ran, how it went, where everything is.
  if (trainer.steps_taken() > start_step)
    fmt::print(stderr, "done      steps {}..{} in {:.1f} s ({:.0f} tokens/s over the run); loss {:.6g} at step {}, {:.6g} "
                       "at step {}\n", start_step + 1, trainer.steps_taken(), total_seconds,
               double(total_tokens) / std::max(total_seconds, 1e-9), first_loss, start_step + 1, last_loss,
               trainer.steps_taken());
  std::string outputs;
  const auto add = [&](const char* what, const std::string& where) {
    if (!where.empty()) outputs += (outputs.empty() ? "" : "; ") + std::string(what) + " " + where;
  };
  if (finished) {  // what this invocation wrote: the outputs the finished run did not have
    add("model", keep_model ? "" : r.save_model);
    add("adapter", keep_adapter ? "" : r.save_adapter);
    add("record", keep_json ? "" : r.json);
    fmt::print(stderr, "outputs   {}\n", outputs.empty() ? "none new" : outputs + " (of the final checkpoint, step " +
                                                                           std::to_string(start_step) + ")");
    return 0;
  }
  add("gradients", r.save_grads);
  add("model", r.save_model);
  add("adapter", r.save_adapter);
  add("metrics", a.metrics);
  add("checkpoints", a.save_every > 0 ? checkpoint_dir : std::string());
  add("record", r.json);
  fmt::print(stderr, "outputs   {}\n", outputs.empty() ? "none (--save-model, --metrics, --checkpoint-dir, --json)" : outputs);
  return 0;
}

}  // namespace sbp
