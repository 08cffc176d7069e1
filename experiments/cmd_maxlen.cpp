// `streambp maxlen`: the maximum sequence length of each BP method under a byte budget (the paper's Table 3 and
// Fig. 4). The analytic memory model predicts it (the largest T whose model peak fits); measurement confirms it: a
// run at T that completes under the budget and one at the next step up (T · (1 + step)) that exceeds it, both
// recorded, starting from the prediction and walking up or down by the step. The CPU meter enforces the budget like a
// full GPU would (c10::OutOfMemoryError), so an over-budget run costs at most its time up to that allocation.
// Data-parallel (--nproc N, Table 4): every probe is a training step of N ranks, each on its --batch / N rows of the
// global batch, under a per-rank budget; the ranks run each step to its end and the probe fits when every rank's
// peak does (ranks.h: a rank stopped mid-step would leave the others waiting). With --sp S each sequence is split over
// groups of S ranks (ARCHITECTURE.md §16): T* is then the whole sequence's, each rank holding its shard.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <optional>
#include <tuple>

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "experiments/cli_checks.h"
#include "baselines/methods.h"
#include "core/io/dtype.h"
#include "core/io/spec.h"
#include "core/methods/streambp.h"
#include "core/methods/memory_model.h"
#include "core/training/training_memory.h"
#include "core/training/data_parallel.h"
#include "core/training/trainer.h"
#include "core/offload/offload_tier.h"
#include "experiments/commands.h"
#include "experiments/memory_check.h"
#include "experiments/results_table.h"
#include "core/io/input_error.h"

namespace sbp {

namespace {

// The chunk choice goes no lower: each chunk has a fixed cost (its graph, small products) and below 32 the time grows
// faster than T* (tiny under 3 MB: chunks of 8 model 15% more T* than 32, and a step at T = 1183 took 2.8x as long).
constexpr std::int64_t kSmallestChosenChunk = 32;

struct ChunkChoice {
  std::int64_t layer_chunk = 0, head_chunk = 0, model_max_seq = 0;
};

// StreamBP's chunk sizes for a budget, for those the user left open (nullopt): over powers of two from
// kSmallestChosenChunk up to the T* of the smallest chunks (a longer chunk holds the whole sequence), the largest
// chunks (fewest, so the fastest) whose modelled T* is within `step` of the best candidate's; a closer T* than that
// the measured search cannot tell apart.
ChunkChoice choose_streambp_chunks(std::optional<std::int64_t> layer_chunk, std::optional<std::int64_t> head_chunk,
                                   double step, const std::function<std::int64_t(std::int64_t, std::int64_t)>& max_seq_of) {
  const auto longest = max_seq_of(layer_chunk.value_or(kSmallestChosenChunk), head_chunk.value_or(kSmallestChosenChunk));
  std::vector<std::int64_t> powers;
  for (auto c = kSmallestChosenChunk; c == kSmallestChosenChunk || c <= longest; c *= 2) powers.push_back(c);
  const auto candidates = [&](std::optional<std::int64_t> given) {
    return given ? std::vector<std::int64_t>{*given} : powers;
  };
  std::vector<ChunkChoice> tried;
  std::int64_t best = 0;
  for (const auto lc : candidates(layer_chunk))
    for (const auto hc : candidates(head_chunk)) {
      tried.push_back({lc, hc, max_seq_of(lc, hc)});
      best = std::max(best, tried.back().model_max_seq);
    }
  ChunkChoice chosen;
  for (const auto& c : tried)
    if (double(c.model_max_seq) * (1 + step) >= double(best) &&
        std::tie(c.layer_chunk, c.head_chunk) > std::tie(chosen.layer_chunk, chosen.head_chunk))
      chosen = c;
  return chosen;
}


// Before any rank starts: what the flags cannot mean together.
void check_maxlen_flags(const MaxlenArgs& a, bool training) {
  if (a.ranks.nproc > 1 && !training)
    throw InputError("--nproc: a data-parallel probe is a training step; give --optimizer (e.g. adamw:lr=1e-5)");
  const auto rows = a.measure.batch_size();  // the global batch
  const int sp = std::max(a.ranks.sp, 1), data_parts = a.ranks.nproc / sp;  // --sp S: groups of S share their rows
  if (!rank_from_environment())
    if (const auto problem = sequence_layout_problem(a.ranks.nproc, sp); !problem.empty())
      throw InputError(problem);
  if (rows % data_parts != 0)
    throw InputError(uneven_batch(data_parts, "--batch " + std::to_string(rows), rows));
  if (sp > 1)
    for (const auto& spec : a.methods) {
      const auto m = make_method(spec);
      if (!m->runs_sequence_shards())
        throw InputError("--sp " + std::to_string(sp) + ": method " + m->spec() +
                                    " does not run on a sequence-parallel rank's shard");
    }
  check_offload_kinds(a.offload, training, a.ranks.nproc, a.ranks.zero);
  // Packed probes are one process's: the model's rows are the drawn rows, where ranks would each take a share of them.
  if (a.pack.packed() && a.ranks.nproc > 1)
    throw InputError("--pack with --nproc " + std::to_string(a.ranks.nproc) + ": packed probes run in one process");
}

// One measured run at a length T.
struct Probe {
  std::int64_t T;
  Measurement m;
  std::int64_t host_peak_bytes = 0;  // the offload tier's
};

// The measured bracket: the largest T that fit and the T one step above it that did not (0: none), walking from
// `start` up while probes fit, else down until one does.
struct Bracket {
  std::int64_t fits = 0, fails = 0;
};
Bracket walk_to_bracket(std::int64_t start, std::int64_t shortest, std::int64_t max_seq, double step,
                        const std::function<bool(std::int64_t)>& probe) {
  const auto up = [&](std::int64_t T) { return std::max(T + 1, std::int64_t(std::ceil(double(T) * (1 + step)))); };
  const auto down = [&](std::int64_t T) { return std::min(T - 1, std::int64_t(std::floor(double(T) / (1 + step)))); };
  Bracket b;
  if (probe(start)) {
    b.fits = start;
    while (b.fits < max_seq && probe(up(b.fits))) b.fits = up(b.fits);
    b.fails = b.fits < max_seq ? up(b.fits) : 0;
    return b;
  }
  b.fails = start;
  for (auto t = down(start); t >= shortest; t = down(t)) {
    if (probe(t)) {
      b.fits = t;
      break;
    }
    b.fails = t;
  }
  return b;
}

// The search on this rank: per method, the model's T* under the budget, then (unless --model-only) the probes that
// bracket the measured T*, their rows written after every method.
class MaxlenSearch {
 public:
  MaxlenSearch(const MaxlenArgs& a, const std::optional<RankEnv>& env, const std::string& command_line);
  int run();

 private:
  Batch batch_at(std::int64_t T) const;
  Workload workload_at(std::int64_t T) const;
  MemoryEstimate modelled(const BackpropMethod& method, std::int64_t T) const;
  std::int64_t modelled_max_seq(const BackpropMethod& method) const;
  std::unique_ptr<BackpropMethod> method_for_budget(const std::string& spec_text) const;
  Trainer make_trainer(BackpropMethod& method, DataParallel* parallel, OffloadTier* tier) const;
  Probe probe(BackpropMethod& method, OffloadTier* tier, std::int64_t T) const;
  void search(const std::string& spec_text);
  void add_rows(const BackpropMethod& method, const OffloadTier* tier, const std::vector<Probe>& probes,
                std::int64_t predicted, const Bracket& bracket);

  const MaxlenArgs& a_;
  const std::optional<OptimizerOptions> optimizer_;
  const std::int64_t rows_;  // the global batch
  const int sp_, data_parts_;
  // The model's answer is the largest T in [shortest_, max_seq]: a sequence split over S ranks has at least 2S
  // positions (every rank two, one per zig-zag part).
  const std::int64_t shortest_;
  Setup setup_;
  Ranks ranks_;
  bool writer_ = false;
  std::shared_ptr<const Objective> objective_;
  std::unique_ptr<Model> model_;
  std::string precision_;
  Workload base_workload_;
  ResultsTable table_;
  Provenance prov_;
  std::filesystem::path csv_;
  std::vector<std::string> summary_;
  std::chrono::steady_clock::time_point started_;
};

MaxlenSearch::MaxlenSearch(const MaxlenArgs& a, const std::optional<RankEnv>& env, const std::string& command_line)
    : a_(a),
      optimizer_(a.optimizer.options()),
      rows_(a.measure.batch_size()),
      sp_(std::max(a.ranks.sp, 1)),
      data_parts_(a.ranks.nproc / sp_),
      shortest_(2 * sp_),
      setup_(a.setup),
      table_({"objective", "lora", "optimizer", "batch_size", "seq_len", "budget_bytes", "role", "peak_bytes",
              "model_peak_bytes", "bp_seconds", "model_max_seq", "measured_max_seq", "model_error", "world_size",
              "zero", "sequence_parallel", "offload", "host_peak_bytes", "model_host_bytes", "pack"}) {
  // --model-only: one process answers for a rank of the layout the flags ask for (its ZeRO stage and groups are the
  // workload's, not this process's; --zero without --nproc N is still refused), with a rank's one intra-op thread.
  auto flags = a.ranks;
  if (a.model_only) {
    flags.sp = 1;
    flags.sp_scheme = SequenceScheme::allgather;  // the scheme is the workload's (a.ranks.add_to), not this process's
    if (flags.nproc > 1) {
      flags.zero = 0;
      if (setup_.threads == 0) setup_.threads = 1;
    }
  }
  ranks_ = join_ranks(flags, env, setup_);
  writer_ = ranks_.writer();
  objective_ = build_objective(setup_);
  if (a.pack.packed())
    if (const auto why = objective_->packed_rows_refusal(); !why.empty()) throw InputError("--pack: " + why);
  model_ = build_model(setup_);
  model_->to(ranks_.device);
  precision_ = precision_name(model_->dtype(), model_->grad_dtype());
  // The memory model needs the prepared objective's per-token buffers, which do not depend on T: one small batch.
  // Training: the optimizer's states and update of this model's trainable tensors join every T's workload.
  const auto small = batch_at(std::max(16, 2 * sp_));
  base_workload_ = make_workload(*model_, objective_->prepare(small, model_->config()), small);
  a.offload.add_to(base_workload_);
  // The models are per rank: of the ranks joined, or (--model-only) of those the flags ask for.
  if (a.model_only)
    a.ranks.add_to(base_workload_, ranks_.device);
  else
    ranks_.add_to(base_workload_);
  if (optimizer_) add_optimizer_memory(base_workload_, *model_, *optimizer_);
  prov_ = collect_provenance(command_line, describe_device(ranks_.device));
  if (!a.model_only && writer_) std::filesystem::create_directories(a.output.out_dir);
  csv_ = ResultsTable::new_path(a.output.out_dir, "maxlen", prov_);
  started_ = std::chrono::steady_clock::now();
}

// This rank's rows of the global batch of --batch rows (--model-only for --nproc N: one rank's share, in one process).
Batch MaxlenSearch::batch_at(std::int64_t T) const {
  if (ranks_.world == 1)
    return prepared_random_batch(*model_, *objective_, rows_ / data_parts_, T, setup_.group, setup_.seed, a_.pack);
  auto global = prepared_random_batch(*model_, *objective_, rows_, T, setup_.group, setup_.seed);
  if (ranks_.data_world() == 1) return global;
  return objective_->split(global, ranks_.data_world(), "random batch").at(std::size_t(ranks_.data_rank()));
}

Workload MaxlenSearch::workload_at(std::int64_t T) const {
  auto w = base_workload_;
  w.seq_len = T;
  pack_workload(w, a_.pack, setup_.seed);  // the rows batch_at(T) packs
  return w;
}

MemoryEstimate MaxlenSearch::modelled(const BackpropMethod& method, std::int64_t T) const {
  const auto w = workload_at(T);
  return optimizer_ ? training_memory(method, w) : method.memory_model(w);
}

// The largest T in [shortest_, max_seq] whose modelled peak fits, 1 when not even the shortest does.
std::int64_t MaxlenSearch::modelled_max_seq(const BackpropMethod& method) const {
  return std::max<std::int64_t>(
      1, longest_fitting_seq([&](std::int64_t T) { return modelled(method, T).total_bytes(); }, shortest_, a_.max_seq,
                             a_.measure.budget_bytes));
}

// StreamBP's default chunks (512, 1024) are longer than what a small budget allows, and a chunk of T or more does
// not stream (issue #44: tiny under 3 MB reached 324 with them, 1183 with 32): the chunks the spec leaves open are
// chosen for the budget.
std::unique_ptr<BackpropMethod> MaxlenSearch::method_for_budget(const std::string& spec_text) const {
  auto method = make_method(spec_text);
  const auto parsed = parse_spec(spec_text);
  if (parsed.name != "streambp") return method;
  const auto given = [&](const char* key) {
    return parsed.options.count(key) ? std::optional(parsed.get_int(key, 0, 1)) : std::nullopt;
  };
  const auto layer_chunk = given("layer_chunk"), head_chunk = given("head_chunk");
  if (layer_chunk && head_chunk) return method;
  const auto spec_of = [](std::int64_t lc, std::int64_t hc) {
    return fmt::format("streambp:layer_chunk={},head_chunk={}", lc, hc);
  };
  const auto choice = choose_streambp_chunks(layer_chunk, head_chunk, a_.step, [&](std::int64_t lc, std::int64_t hc) {
    return modelled_max_seq(*make_method(spec_of(lc, hc)));
  });
  if (writer_)
    fmt::print(stderr, "{}: chunks chosen for the budget: {} (modelled T* {}; with {}: {}); give both chunk "
               "sizes to keep your own\n", spec_text, spec_of(choice.layer_chunk, choice.head_chunk),
               choice.model_max_seq, method->spec(), modelled_max_seq(*method));
  return make_method(spec_of(choice.layer_chunk, choice.head_chunk));
}

// A training step's trainer: the schedule's horizon and accumulation do not change its memory.
Trainer MaxlenSearch::make_trainer(BackpropMethod& method, DataParallel* parallel, OffloadTier* tier) const {
  TrainOptions options;
  options.optimizer = *optimizer_;
  if (a_.offload.optimizer()) options.optimizer_tier = tier;
  if (a_.offload.gradients()) options.gradient_tier = tier;
  if (a_.offload.parameters() && !parallel) options.parameter_tier = tier;  // on ranks: DataParallel's
  ranks_.add_to(options);
  return Trainer(*model_, method, *objective_, options, parallel);
}

// One measured run at T under the budget: forward + backward, or two training steps of a fresh optimizer.
Probe MaxlenSearch::probe(BackpropMethod& method, OffloadTier* tier, std::int64_t T) const {
  const auto batch = batch_at(T);
  if (tier) tier->reset_peak();
  auto m = [&] {
    if (!optimizer_) return measure_method(*model_, method, *objective_, batch, 0, 1, a_.measure.budget_bytes);
    // Fresh states (and, data-parallel, fresh shards), freed after the probe.
    std::unique_ptr<DataParallel> parallel;
    if (ranks_.comm)
      parallel = std::make_unique<DataParallel>(*ranks_.comm, ranks_.zero, a_.offload.parameters() ? tier : nullptr);
    auto trainer = make_trainer(method, parallel.get(), tier);
    auto measured = measure_training_on_ranks(trainer, ranks_, batch, 0, 2, a_.measure.budget_bytes);
    if (parallel) parallel->unshard();  // ZeRO-3: the next probe starts from the whole model
    return measured;
  }();
  const auto spec = method.spec();
  const auto elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  if (writer_)
    fmt::print(stderr, "  {} T={:<8} {}  (elapsed {:.0f} s)\n", spec, T,
               !m.finished() ? std::string("over the budget")
                                 : fmt::format("fits: peak {} in {:.2f} s", format_bytes(m.peak_bytes), m.bp_seconds.at(0)),
               elapsed);
  return {T, m, tier ? tier->peak_bytes() : 0};
}

// One method: its prediction, then (unless --model-only) the probes from it to the bracket, their rows and the
// summary line.
void MaxlenSearch::search(const std::string& spec_text) {
  auto method = method_for_budget(spec_text);
  const auto spec = method->spec();
  const bool training = optimizer_.has_value();
  const auto tier = make_offload(a_.offload, ranks_.device, *method, training, a_.ranks.nproc, a_.ranks.zero);
  Subscription offloading;
  if (training)
    method->offload_checkpoints_to(a_.offload.checkpoints() ? tier.get() : nullptr);  // the Trainer moves the grads
  else
    offloading = offload_backprop(a_.offload, *method, tier.get());
  const auto predicted = modelled_max_seq(*method);
  if (writer_) {
    fmt::print(stderr, "{}: the model predicts T* = {} under {}{}\n", spec, predicted, format_bytes(a_.measure.budget_bytes),
               ranks_.world > 1 ? " per rank" + ranks_.describe() : "");
    if (const auto advice = streambp_chunk_advice(*method, std::max(predicted, shortest_)); !advice.empty())
      fmt::print(stderr, "warning: {}\n", advice);
  }
  if (a_.model_only) return;
  std::vector<Probe> probes;
  const auto bracket = walk_to_bracket(std::max(predicted, shortest_), shortest_, a_.max_seq, a_.step, [&](std::int64_t T) {
    probes.push_back(probe(*method, tier.get(), T));
    return probes.back().m.finished();
  });
  add_rows(*method, tier.get(), probes, predicted, bracket);
  if (writer_) table_.write_to(csv_, prov_);  // after every method: a killed search keeps the methods it finished
}

// The method's probes as rows (role max, next or probe), and its line of the summary.
void MaxlenSearch::add_rows(const BackpropMethod& method, const OffloadTier* tier, const std::vector<Probe>& probes,
                            std::int64_t predicted, const Bracket& bracket) {
  const auto spec = method.spec();
  const auto [fits, fails] = bracket;
  const std::string measured = fits > 0 ? std::to_string(fits) : "";
  const std::string error = fits > 0 ? fmt::format("{:.4f}", double(predicted) / double(fits) - 1.0) : "";
  for (const auto& p : probes) {
    const bool oom = !p.m.finished();
    const std::string role = p.T == fits ? "max" : p.T == fails ? "next" : "probe";
    const auto model = modelled(method, p.T);
    const char* status = oom ? step_status_name(StepStatus::oom) : check_status_name(CheckStatus::unchecked);
    table_.add({setup_.source.describe(), spec, precision_, status, setup_.seed,
                {objective_->spec(), model_->lora().enabled() ? model_->lora().spec() : "", a_.optimizer.describe(),
                 std::to_string(rows_), std::to_string(p.T), std::to_string(a_.measure.budget_bytes), role,
                 oom ? "" : std::to_string(p.m.peak_bytes), std::to_string(model.total_bytes()),
                 oom ? "" : fmt::format("{:.4f}", p.m.median_seconds()), std::to_string(predicted), measured, error,
                 std::to_string(ranks_.world), std::to_string(ranks_.zero), std::to_string(sp_),
                 a_.offload.describe(), tier && !oom ? std::to_string(p.host_peak_bytes) : "",
                 tier ? std::to_string(model.host_bytes()) : "", a_.pack.packed() ? a_.pack.spec() : ""}});
  }
  summary_.push_back(fmt::format("{:<44} model T* = {:>8}   measured T* = {:>8} (T = {} over the budget)   model error {}",
                                 spec, predicted, measured.empty() ? "-" : measured,
                                 fails > 0 ? std::to_string(fails) : "-", error.empty() ? "-" : error));
}

int MaxlenSearch::run() {
  for (const auto& spec_text : a_.methods) search(spec_text);
  if (a_.model_only || !writer_) return 0;
  fmt::print("\nmaximum T under {}{} ({}, {}, B = {}{}, {}):\n", format_bytes(a_.measure.budget_bytes),
             ranks_.world > 1 ? " per rank" : "", precision_, objective_->spec(), rows_,
             ranks_.world > 1 ? fmt::format(" ({} per rank){}", rows_ / ranks_.data_world(), ranks_.describe()) : "",
             optimizer_ ? "training steps: " + a_.optimizer.describe() : "forward + backward");
  for (const auto& line : summary_) fmt::print("  {}\n", line);
  fmt::print("\nresults: {}\n", std::filesystem::absolute(csv_).string());
  return 0;
}

}  // namespace

void add_maxlen_options(CLI::App& app, MaxlenArgs& a) {
  add_setup_options(app, a.setup, {.adapter = false, .default_preset = "qwen3-small"});
  add_measure_options(app, a.measure, {.seq = Arity::none, .budget = true, .budget_required = true});
  add_methods_option(app, a.methods, "the methods searched, one after the other");
  app.add_option("--step", a.step, "resolution: the failing run is at T * (1 + step)")->check(sbp::within(0.001, 1.0));
  app.add_option("--max-seq", a.max_seq, "upper end of the search")->check(sbp::within(std::int64_t(16), std::int64_t(1) << 30))->capture_default_str();
  add_output_options(app, a.output, "results folder");
  add_optimizer_options(app, a.optimizer, "search training steps (BP + optimizer update): the optimizer's states and "
                        "the update's temporaries share the budget; each measured probe is two steps of a fresh "
                        "optimizer (the second holds the states through its BP); default: forward + backward only");
  add_offload_options(app, a.offload, "the budget is the device's (the meter's), and the tier's bytes are "
                      "recorded beside each probe (host_peak_bytes, model_host_bytes)");
  app.add_flag("--model-only", a.model_only, "print the model's predictions and stop (no measurement, no file)");
  add_rank_options(app, a.ranks, "each measuring its --batch / N rows of every probe's global batch under the "
                   "per-rank budget (needs --optimizer)");
  add_sequence_parallel_option(app, a.ranks);
  add_pack_option(app, a.pack);
}

int maxlen_command(const MaxlenArgs& a, const std::string& command_line) {
  check_maxlen_flags(a, a.optimizer.options().has_value());
  const auto env = rank_from_environment();
  if (a.ranks.nproc > 1 && !env && !a.model_only) return launch_ranks(a.ranks.nproc);
  MaxlenSearch search(a, env, command_line);
  return search.run();
}

}  // namespace sbp
