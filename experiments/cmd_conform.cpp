// `streambp conform`: runs an external implementation over the conformance matrix (verify/conformance.h) through the
// file protocol (docs/conformance.md), judges its gradients against the harness's fp64 standard BP (fp64 cases) or
// by the low-precision rule against a baseline in the same dtype, and exits 1 when any case fails. Every case runs
// in its own directory; the implementation is a child process in its own process group, killed after --timeout
// (experiments/conform_child.h); its wall time, CPU time (rusage) and peak RSS are recorded, so a conformance run is
// also a side-by-side.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>

#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "baselines/methods.h"
#include "core/model/checkpoint_io.h"
#include "core/io/dtype.h"
#include "core/io/safetensors.h"
#include "core/objectives/catalogue.h"
#include "experiments/batches.h"
#include "experiments/commands.h"
#include "experiments/conform_case_files.h"
#include "experiments/conform_child.h"
#include "experiments/conform_diagnosis.h"
#include "experiments/interrupt.h"
#include "experiments/junit.h"
#include "experiments/results_table.h"
#include "verify/conform_packed.h"
#include "verify/conformance.h"
#include "verify/rl_step_oracle.h"
#include "core/io/input_error.h"

namespace sbp {

namespace fs = std::filesystem;

namespace {

constexpr double kExactRtol = 1e-10;
// An adapter's exit status for a case its library cannot express (a padding side, a loss, a model family it does not
// have): reported as such, neither passed nor failed (protocol.py's NotExpressible).
constexpr int kNotExpressible = 3;

// The python with torch, transformers and peft: STREAMBP_PYTHON, else the build's venv (CMake's STREAMBP_PYTHON);
// empty when neither is known.
std::string harness_python() {
  const char* env = std::getenv("STREAMBP_PYTHON");
  return env && *env ? env : STREAMBP_DEFAULT_PYTHON;
}

// The shipped adapters by name, else the user's command as given.
std::string resolve_command(const std::string& impl) {
  const auto python = harness_python().empty() ? std::string("python3") : harness_python();
  const auto adapter = fs::path(STREAMBP_SOURCE_DIR) / "verify" / "conform" / "hf_adapter.py";
  if (impl == "hf") return quoted(python) + " " + quoted(adapter.string());
  if (impl == "hf-checkpointing") return quoted(python) + " " + quoted(adapter.string()) + " --gradient-checkpointing";
  return impl;
}

}  // namespace

void add_conform_options(CLI::App& app, ConformArgs& a) {
  app.add_option("--impl", a.impl, "the implementation: a shell command (the case directory is appended as its last "
                 "argument), or a shipped adapter: hf (HF Transformers standard BP; PEFT for LoRA) or "
                 "hf-checkpointing (HF gradient checkpointing); required unless --list-cases");
  app.add_option("--baseline", a.baseline, "the low-precision cases' yardstick in the same dtype: a command or hf");
  app.add_option("--cases", a.cases, "a case set: ci, quick, full, survey, rl (whole RL steps, docs/rl-steps.md) or rl-verl (the rl "
                 "cases declared as verl documents them); or a JSON file of cases "
                 "(docs/conformance.md)");
  app.add_option("--objectives", a.objectives, "only these objectives, comma-separated (sft,grpo,dpo)")
      ->delimiter(',')->check(CLI::IsMember(objective_names()));
  app.add_option("--dtypes", a.dtypes, "only these dtypes, comma-separated (fp64,fp32,bf16)")
      ->delimiter(',')->check(CLI::IsMember({"fp64", "fp32", "bf16"}));
  app.add_flag("--lora", a.lora_only, "only the LoRA cases");
  app.add_option("--only", a.only, "only these cases of the set, by name, comma-separated (a pytest item runs one)")
      ->delimiter(',');
  app.add_flag("--list-cases", a.list_cases, "print the selected cases as JSON (name, id, description, objective, dtype, "
               "lora, batch, seq, ranks, parallel, micro_batches, pack_lengths, tied, chunks) and run nothing");
  app.add_option("--accumulation", a.accumulation, "what a step of several micro-batches is judged against: union "
                 "(the loss over their union, normalised by the step's target count) or micro-means (the mean of each "
                 "micro-batch's own loss, for a library that documents it)")
      ->check(CLI::IsMember({"union", "micro-means"}));
  app.add_option("--junit", a.junit, "also write a JUnit XML report here (one testcase per case; a failure's message "
                 "its worst tensor, error, bar and hint; N/A as skipped), for a CI's test page");
  app.add_option("--timeout", a.timeout, "seconds per case before the implementation is killed")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  add_output_options(app, a.output, "results folder");
  app.add_option("--work", a.work_dir, "where the case directories go; the failing ones stay there for a rerun by "
                 "hand (default: a fresh temporary folder, removed when the run ends)");
  app.add_option("--judge", a.judge_dir, "judge a case directory that --work kept (DIR/CASE), as it is, again: --impl "
                 "runs on its files and its gradients are judged, without writing or running the rest of the matrix "
                 "(the case is found by its case.json's name in the built-in sets, or in --cases FILE)")
      ->check(CLI::ExistingDirectory);
}

// What a failing line says after its columns, on one line (a crash's lines joined; impl.log keeps them as they
// were): the problem, and for a gradient beyond its bar the bar itself and what such an error usually means.
// `loss_rel`: the loss's relative error (NaN when there is none).
static std::string failure_words(c10::ScalarType dtype, const ConformVerdict& verdict, bool compared, double loss_rel) {
  std::string words = verdict.problem;
  for (auto& ch : words)
    if (ch == '\n' || ch == '\r') ch = ' ';
  if (!compared || verdict.passed) return words;
  std::string why;
  if (dtype == c10::kDouble) {
    why = fmt::format("normwise error {:.1e} > the fp64 bar {:.0e}", verdict.worst, kExactRtol);
  } else {
    why = fmt::format("{:.2f}x the low-precision rule's bar (allowance x the baseline's l2 error + floor; <= 1 passes)",
                      verdict.worst);
  }
  // A mean's rounding moves the loss far less than 1% in any dtype; a different denominator moves it that much.
  if (!verdict.hint.empty())
    why += "; " + verdict.hint;
  else if (loss_rel > 1e-2)
    why += fmt::format("; the loss is {:.1e} off too: usually the normaliser (the token losses' sum divided by "
                       "something else than the batch's target count: per row, per chunk, padding counted) "
                       "(docs/conformance.md)", loss_rel);
  else if (dtype == c10::kDouble && verdict.worst > 1e-9 && verdict.worst < 1e-4)
    why += "; ~1e-7 in fp64 is usually a norm, softmax or loss computed in fp32: HF's RMSNorm is, even in an fp64 "
           "model (streambp_conform.hf.fp64_exact() patches it; docs/conform-in-ci.md)";
  return words.empty() ? why : words + "; " + why;
}

// A JUnit row for a case: grouped by objective on a CI page, named by the case's id (pytest's items carry it too).
static JUnitCase junit_case(const ConformCase& c, JUnitCase::Status status, std::string message, std::string details,
                            double seconds) {
  return {"streambp.conform." + c.objective.substr(0, c.objective.find(':')), conform_case_id(c), status,
          std::move(message), std::move(details), seconds};
}

namespace {

// The cases of --cases that --objectives, --dtypes, --lora and --only keep (none: an input error).
std::vector<ConformCase> select_cases(const ConformArgs& a) {
  std::vector<ConformCase> cases;
  const auto& objectives = a.objectives;
  const auto& dtypes = a.dtypes;
  for (auto& c : conform_cases(a.cases)) {
    const auto name = c.objective.substr(0, c.objective.find(':'));
    if (!objectives.empty() && std::find(objectives.begin(), objectives.end(), name) == objectives.end()) continue;
    if (!dtypes.empty() && std::find_if(dtypes.begin(), dtypes.end(), [&](const std::string& d) {
          return parse_dtype(d) == c.dtype;
        }) == dtypes.end())
      continue;
    if (a.lora_only && c.lora.empty()) continue;
    if (!a.only.empty() && std::find(a.only.begin(), a.only.end(), c.name) == a.only.end()) continue;
    cases.push_back(std::move(c));
  }
  if (cases.empty()) throw InputError("--cases/--objectives/--dtypes/--lora/--only select no case");
  return cases;
}

// --list-cases: the selected cases as JSON on stdout.
void print_case_list(const std::vector<ConformCase>& cases) {
  auto list = nlohmann::json::array();
  for (const auto& c : cases)
    list.push_back({{"name", c.name}, {"id", conform_case_id(c)}, {"kind", conform_kind(c)},
                    {"description", c.description}, {"objective", c.objective},
                    {"dtype", dtype_name(c.dtype)}, {"lora", c.lora}, {"batch", c.batch.batch_size},
                    {"seq", c.batch.seq_len}, {"ranks", c.ranks}, {"parallel", parallel_name(c.parallel)},
                    {"micro_batches", c.micro_batches}, {"pack_lengths", c.pack_lengths},
                    {"tied", c.config.tie_word_embeddings},
                    {"chunks", {{"layer", c.layer_chunk}, {"head", c.head_chunk}}}});
  fmt::print("{}\n", list.dump(2));
}

// The folder the cases run in: --work, else a temporary one that goes however the run ends (passed, failed, an
// error, Ctrl-C); --work keeps what failed.
class WorkFolder {
 public:
  explicit WorkFolder(const std::string& given) : path_(given) {
    if (path_.empty()) {
      auto pattern = (fs::temp_directory_path() / "streambp-conform-XXXXXX").string();
      if (!mkdtemp(pattern.data())) throw std::runtime_error("cannot create a temporary folder");
      path_ = temporary_ = pattern;
    }
    fs::create_directories(path_);
  }
  ~WorkFolder() {
    std::error_code ignored;
    if (!temporary_.empty()) fs::remove_all(temporary_, ignored);
  }
  WorkFolder(const WorkFolder&) = delete;
  WorkFolder& operator=(const WorkFolder&) = delete;
  const fs::path& path() const { return path_; }
  bool temporary() const { return !temporary_.empty(); }

 private:
  fs::path path_, temporary_;
};

// A conformance run over the selected cases: each case's inputs written, the implementation run on them, its
// gradients judged, and its row added to the CSV (and the JUnit report) before the next case starts.
class ConformRun {
 public:
  ConformRun(const ConformArgs& a, std::vector<ConformCase> cases, const std::string& command_line);
  int run();  // 0: every judged case passed; 1: one failed or none was judged; kInterruptedExit: Ctrl-C

 private:
  bool run_case(const ConformCase& c);
  bool run_rl_step_case(const ConformCase& c);
  std::optional<ConformVerdict> judge(const ConformCase& c, const Objective& objective, const fs::path& dir,
                                      const Batch& batch, const TensorList& reference, double reference_loss,
                                      const Returned& got, ChildRun& base_run);
  void record_not_expressible(const ConformCase& c, const Objective& objective, double reference_loss,
                              const ChildRun& run, const std::string& judged_against);
  void record_verdict(const ConformCase& c, const Objective& objective, double reference_loss, const Returned& got,
                      const ConformVerdict& verdict, const ChildRun& run, const ChildRun& base_run,
                      const std::string& judged_against);
  void add_line(const std::string& line);
  void write_report() const;
  int summarize() const;

  const ConformArgs& a_;
  const std::vector<ConformCase> cases_;
  const std::string impl_, baseline_;
  const Accumulation accumulation_;
  WorkFolder work_;
  Provenance prov_;
  std::filesystem::path csv_;
  ResultsTable table_;
  std::vector<std::string> lines_;
  std::vector<JUnitCase> junit_;
  std::vector<std::pair<std::string, std::string>> junit_properties_;
  int passed_ = 0, failed_ = 0, not_expressible_ = 0;
  std::string failed_run_;  // the first command that failed to run: what it was, its output's end, its python
};

ConformRun::ConformRun(const ConformArgs& a, std::vector<ConformCase> cases, const std::string& command_line)
    : a_(a),
      cases_(std::move(cases)),
      impl_(resolve_command(a.impl)),
      baseline_(resolve_command(a.baseline)),
      accumulation_(parse_accumulation(a.accumulation)),
      work_(a.work_dir),
      table_({"case", "description", "objective", "lora", "rule", "worst_tensor", "worst", "loss", "oracle_loss",
              "loss_rel_error", "seconds", "cpu_seconds", "peak_rss_bytes", "baseline_seconds",
              "baseline_peak_rss_bytes", "problem", "impl", "accumulation", "impl_python", "impl_torch_version",
              "baseline_python", "baseline_torch_version"}) {
  watch_interrupts("\ninterrupt: stopping the implementation and the run (Ctrl-C again to stop at once)\n");
  prov_ = collect_provenance(command_line);
  fs::create_directories(a.output.out_dir);
  csv_ = ResultsTable::new_path(a.output.out_dir, "conform", prov_);
  // torch_version: the harness's; a testcase's own properties name the implementation's.
  junit_properties_ = {{"commit", prov_.commit}, {"date_utc", prov_.date_utc}, {"machine", prov_.machine},
                       {"torch_version", prov_.torch_version}, {"command", prov_.command}, {"implementation", impl_},
                       {"csv", csv_.string()}};
}

int ConformRun::run() {
  fmt::print(stderr, "conform: {} case(s) of {} in {}; implementation: {}\n", cases_.size(), a_.cases,
             work_.path().string(), impl_);
  for (const auto& c : cases_)
    if (interrupted() || !run_case(c)) break;
  return summarize();
}

// One case: a seeded model in the case dtype (LoRA adapters too) and a random batch with its log-probs completed,
// written with the oracle's answer; then the implementation's run, judged. False when Ctrl-C stopped a child (the
// case then has no row).
bool ConformRun::run_case(const ConformCase& c) {
  if (c.rl_step) return run_rl_step_case(c);
  const bool kept = !a_.judge_dir.empty();  // --judge: the kept directory's files as they are
  const auto dir = kept ? fs::path(a_.judge_dir) : work_.path() / c.name;
  auto objective = make_objective(c.objective);
  Batch batch;
  if (kept) {
    for (const auto* output : {"grads.safetensors", "result.json"}) fs::remove(dir / output);
    batch = read_batch_file(dir / "batch.safetensors");
  } else {
    fs::remove_all(dir);
    Model model(c.config, c.dtype, c.batch.seed);
    if (!c.lora.empty()) model.add_lora(parse_lora_spec(c.lora), c.batch.seed + 1);
    batch = conform_batch(c, *objective);  // packed rows when the case has pack_lengths
    complete_batch(model, *objective, batch, "random batch", true, "", c.dtype, c.batch.seed);
    write_case(c, dir, model, *objective, batch);
  }
  const auto [reference, reference_loss] = oracle(c, dir, batch, accumulation_);
  // A micro-batch case's row names the normalisation it was judged against.
  const auto judged_against = c.micro_batches.empty() ? std::string() : accumulation_description(accumulation_);

  const auto run = run_child(impl_, dir, a_.timeout);
  if (run.interrupted) return false;
  if (failed_run_.empty() && !run.outcome.empty() && run.exit_status != kNotExpressible)
    failed_run_ = failed_run_note("the implementation", impl_, dir, run.outcome, harness_python());
  if (run.exit_status == kNotExpressible) {
    record_not_expressible(c, *objective, reference_loss, run, judged_against);
    if (!kept) fs::remove_all(dir);
    return true;
  }
  const auto got = read_returned(dir, run, c.dtype, c.micro_batches.size());
  ChildRun base_run;
  const auto verdict = judge(c, *objective, dir, batch, reference, reference_loss, got, base_run);
  if (!verdict) return false;
  record_verdict(c, *objective, reference_loss, got, *verdict, run, base_run, judged_against);
  if (verdict->passed && verdict->problem.empty()) {
    if (!kept) fs::remove_all(dir);
    fs::remove_all(work_.path() / (c.name + ".baseline"));
  }
  return true;
}

// A whole RL step (issue #60): the policy at generation time (a seeded fp64 model) and case.json, the oracle's step
// on them (verify/rl_step_oracle.h), then the implementation's trainer, judged at every optimizer step and at each
// stage it returns (judge_rl_step). False when Ctrl-C stopped the child.
bool ConformRun::run_rl_step_case(const ConformCase& c) {
  const bool kept = !a_.judge_dir.empty();
  const auto dir = kept ? fs::path(a_.judge_dir) : work_.path() / c.name;
  const auto objective = make_objective(c.objective);
  if (kept) {
    for (const auto* output : {"grads.safetensors", "result.json"}) fs::remove(dir / output);
  } else {
    fs::remove_all(dir);
    fs::create_directories(dir);
    save_model_dir(Model(c.config, c10::kDouble, c.batch.seed), dir / "model");
    write_file_atomically(dir / "case.json", case_json(c, *objective).dump(2) + "\n");
  }
  auto policy = load_model_dir(dir / "model", at::kDouble);
  const auto reference = run_rl_step(*policy, *c.rl_step, rl_step_stages(), "standard", c.name);
  const double reference_loss = reference.losses.empty() ? 0 : reference.losses.front();  // step 1's, for the row

  const auto run = run_child(impl_, dir, a_.timeout);
  if (run.interrupted) return false;
  if (failed_run_.empty() && !run.outcome.empty() && run.exit_status != kNotExpressible)
    failed_run_ = failed_run_note("the implementation", impl_, dir, run.outcome, harness_python());
  if (run.exit_status == kNotExpressible) {
    record_not_expressible(c, *objective, reference_loss, run, "");
    if (!kept) fs::remove_all(dir);
    return true;
  }
  const auto got = read_returned(dir, run, c10::kDouble, 0, /*with_loss=*/false);
  ConformVerdict verdict;
  if (got.problem.empty()) {
    verdict = judge_rl_step(*c.rl_step, reference, got.grads, kExactRtol);
  } else {
    verdict.rule = "fp64 RL step";
    verdict.problem = got.problem;
  }
  record_verdict(c, *objective, reference_loss, got, verdict, run, ChildRun{}, "");
  if (verdict.passed && verdict.problem.empty() && !kept) fs::remove_all(dir);
  return true;
}

// What the implementation returned, judged: an fp64 case against the oracle (gradients and loss); any other dtype by
// the low-precision rule, beside the baseline's run of the same case (base_run). Nullopt when Ctrl-C stopped the
// baseline.
std::optional<ConformVerdict> ConformRun::judge(const ConformCase& c, const Objective& objective, const fs::path& dir,
                                                const Batch& batch, const TensorList& reference,
                                                double reference_loss, const Returned& got, ChildRun& base_run) {
  ConformVerdict verdict;
  if (!got.problem.empty()) {
    verdict.problem = got.problem;
    verdict.rule = c.dtype == c10::kDouble ? "fp64" : dtype_name(c.dtype);
    return verdict;
  }
  if (c.dtype == c10::kDouble) {
    verdict = judge_exact(reference, got.grads, kExactRtol);
    if (!verdict.passed && verdict.problem.empty())
      verdict.hint = tile_boundary_hint(c, dir, batch, got.grads, verdict.worst);
    const double loss_error = std::abs(*got.loss - reference_loss) / std::max(std::abs(reference_loss), 1e-300);
    if (verdict.problem.empty() && loss_error > kExactRtol) {
      verdict.passed = false;
      verdict.problem = fmt::format("loss {:.17g}, the oracle's {:.17g} (relative error {:.2e})", *got.loss,
                                    reference_loss, loss_error);
    }
    return verdict;
  }
  const auto base_dir = work_.path() / (c.name + ".baseline");
  fs::remove_all(base_dir);
  copy_case(dir, base_dir);
  if (c.ranks != 1) {  // the yardstick is one process's standard BP in the same dtype
    auto one = c;
    one.ranks = 1;
    one.parallel = ConformParallel::data;
    write_file_atomically(base_dir / "case.json", case_json(one, objective).dump(2) + "\n");
  }
  base_run = run_child(baseline_, base_dir, a_.timeout);
  if (base_run.interrupted) return std::nullopt;
  if (failed_run_.empty() && !base_run.outcome.empty())
    failed_run_ = failed_run_note("the baseline", baseline_, base_dir, base_run.outcome, harness_python());
  const auto base = read_returned(base_dir, base_run, c.dtype, c.micro_batches.size());
  if (!base.problem.empty()) {
    verdict.rule = dtype_name(c.dtype);
    verdict.problem = "the baseline " + base.problem;
    return verdict;
  }
  return judge_low_precision(reference, base.grads, got.grads, c.dtype);
}

// The adapter's own word that its library cannot run this case: no gradients to judge, no failure.
void ConformRun::record_not_expressible(const ConformCase& c, const Objective& objective, double reference_loss,
                                        const ChildRun& run, const std::string& judged_against) {
  const auto why = last_line(work_.path() / c.name / "impl.log");
  ++not_expressible_;
  table_.add({c.config.name, a_.impl, dtype_name(c.dtype), "not expressible", c.batch.seed,
              {c.name, c.description, objective.spec(), c.lora, "", "", "", "", fmt::format("{:.17g}", reference_loss),
               "", fmt::format("{:.3f}", run.wall_seconds), fmt::format("{:.3f}", run.cpu_seconds),
               std::to_string(run.peak_rss_bytes), "", "", why, impl_, judged_against, "", "", "", ""}});
  add_line(fmt::format("{:<28} {:<5} {:<4} {:>10} {:<44} {:>6.1f} s {:>8}  {}", c.name, dtype_name(c.dtype), "N/A",
                       "-", "-", run.wall_seconds, format_bytes(run.peak_rss_bytes), "not expressible: " + why));
  table_.write_to(csv_, prov_);
  junit_.push_back(junit_case(c, JUnitCase::Status::skipped, "not expressible: " + why, "", run.wall_seconds));
  write_report();
}

// The case's row, line and JUnit entry, written at once: a killed run keeps what it judged.
void ConformRun::record_verdict(const ConformCase& c, const Objective& objective, double reference_loss,
                                const Returned& got, const ConformVerdict& verdict, const ChildRun& run,
                                const ChildRun& base_run, const std::string& judged_against) {
  const bool pass = verdict.passed && verdict.problem.empty();
  (pass ? passed_ : failed_) += 1;
  const auto loss_rel = got.loss ? std::abs(*got.loss - reference_loss) / std::max(std::abs(reference_loss), 1e-300)
                                 : std::numeric_limits<double>::quiet_NaN();
  const bool compared = !verdict.worst_tensor.empty();  // gradients were judged (a loss problem may come on top)
  const auto micro_words = compared && !c.micro_batches.empty()
                               ? fmt::format("; a step of {} micro-batches judged against {}: usually each "
                                             "micro-batch normalised by its own count, or one micro-batch's gradient "
                                             "missing", c.micro_batches.size(), accumulation_name(accumulation_))
                               : std::string();
  table_.add({c.config.name, a_.impl, dtype_name(c.dtype), pass ? "passed" : "failed", c.batch.seed,
              {c.name, c.description, objective.spec(), c.lora, verdict.rule, verdict.worst_tensor,
               compared ? fmt::format("{:.3e}", verdict.worst) : "",
               got.loss ? fmt::format("{:.17g}", *got.loss) : "", fmt::format("{:.17g}", reference_loss),
               got.loss ? fmt::format("{:.3e}", loss_rel) : "", fmt::format("{:.3f}", run.wall_seconds),
               fmt::format("{:.3f}", run.cpu_seconds), std::to_string(run.peak_rss_bytes),
               c.dtype == c10::kDouble ? "" : fmt::format("{:.3f}", base_run.wall_seconds),
               c.dtype == c10::kDouble ? "" : std::to_string(base_run.peak_rss_bytes), verdict.problem, impl_,
               judged_against, run.provenance.python, run.provenance.torch_version, base_run.provenance.python,
               base_run.provenance.torch_version}});
  // A packed case's usual mistakes (docs/packing.md), each shown by tests/support/conform_packing_faults.py.
  // A packed GRPO case's own (docs/packing.md "GRPO on packed rows"): a per-sequence term taken per row (pack).
  const bool grpo = c.objective.rfind("grpo", 0) == 0;
  const auto packed_words = compared && !c.pack_lengths.empty()
                                ? std::string("; a packed case: usually attention across a sequence boundary (a mask "
                                              "from attention_mask alone, position_ids ignored), positions not "
                                              "restarted per sequence (about 1e-7 in fp64: RoPE's larger angles "
                                              "rounded), ") +
                                      (grpo ? "or a per-sequence term of GRPO taken per row (pack): the advantage "
                                              "(one per pack instead of one per sequence), grpo's token mean or the "
                                              "sequence-level ratio over the whole pack, the count of completions "
                                              "(grpo, dr_grpo) the rows'"
                                            : "or a sequence's first label kept")
                                : std::string();
  const auto words =
      pass ? std::string() : failure_words(c.dtype, verdict, compared, loss_rel) + micro_words + packed_words;
  const auto line = fmt::format("{:<28} {:<5} {:<4} {:>10} {:<44} {:>6.1f} s {:>8}  {}", c.name, dtype_name(c.dtype),
                                pass ? "PASS" : "FAIL", compared ? fmt::format("{:.2e}", verdict.worst) : "-",
                                compared ? verdict.worst_tensor : "-", run.wall_seconds,
                                format_bytes(run.peak_rss_bytes), words);
  add_line(line);
  table_.write_to(csv_, prov_);
  junit_.push_back(junit_case(
      c, pass ? JUnitCase::Status::passed : JUnitCase::Status::failed,
      compared ? fmt::format("worst tensor '{}': {:.2e}; {}", verdict.worst_tensor, verdict.worst, words) : words,
      line, run.wall_seconds));
  for (const auto& [who, p] : {std::pair{"impl", run.provenance}, std::pair{"baseline", base_run.provenance}}) {
    if (!p.python.empty()) junit_.back().properties.emplace_back(std::string(who) + "_python", p.python);
    if (!p.torch_version.empty()) junit_.back().properties.emplace_back(std::string(who) + "_torch_version", p.torch_version);
  }
  write_report();
}

void ConformRun::add_line(const std::string& line) {
  fmt::print(stderr, "  {}\n", line);
  lines_.push_back(line);
}

// After every case, as the CSV: a killed run keeps what it judged.
void ConformRun::write_report() const {
  if (!a_.junit.empty()) write_junit(a_.junit, "streambp conform " + a_.cases, junit_, junit_properties_);
}

// The table of every case, the count, where the failing cases' inputs are, and the exit code.
int ConformRun::summarize() const {
  fmt::print("\n{:<28} {:<5} {:<4} {:>10} {:<44} {:>8} {:>8}\n", "case", "dtype", "", "worst", "tensor (fp64: normwise "
             "error; else ratio to the bar)", "time", "peak RSS");
  for (const auto& line : lines_) fmt::print("{}\n", line);
  const auto judged = passed_ + failed_;
  fmt::print("\n{} of {} case(s) passed{}; results: {}\n", passed_, judged,
             not_expressible_ ? fmt::format(" ({} more not expressible by the implementation)", not_expressible_) : "",
             std::filesystem::absolute(csv_).string());
  if (!failed_run_.empty()) fmt::print("{}", failed_run_);
  if (failed_ > 0 && !a_.judge_dir.empty())
    fmt::print("the case's directory: {}; rerun it by hand: {} {}\n", a_.judge_dir, impl_, a_.judge_dir);
  else if (failed_ > 0 && work_.temporary())
    fmt::print("the failing cases' directories went with the temporary folder; --work DIR keeps them (inputs, the "
               "implementation's output, impl.log) to rerun one by hand: {} DIR/CASE, or to judge one again after a "
               "fix: streambp conform --impl ... --judge DIR/CASE\n", impl_);
  else if (failed_ > 0)
    fmt::print("the failing cases' directories (inputs, the implementation's output, impl.log): {}; rerun one by "
               "hand: {} {}/CASE; judge one again after a fix: streambp conform --impl ... --judge {}/CASE\n",
               work_.path().string(), impl_, work_.path().string(), work_.path().string());
  if (interrupted()) {
    fmt::print("interrupted (Ctrl-C) after {} of {} case(s)\n", judged + not_expressible_, cases_.size());
    return kInterruptedExit;
  }
  if (judged == 0) {
    fmt::print("no case was judged: the implementation declared every selected case not expressible (exit status {})\n",
               kNotExpressible);
    return 1;
  }
  return failed_ > 0 ? 1 : 0;
}

// --judge DIR/CASE: the case its case.json names, looked up in --cases FILE or the built-in sets, and checked to be
// what this harness writes for it (a directory of another version or a hand-edited one is judged by nothing).
std::vector<ConformCase> kept_case(const ConformArgs& a) {
  const fs::path dir(a.judge_dir);
  nlohmann::json meta;
  try {
    std::ifstream in(dir / "case.json");
    meta = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw InputError("--judge " + a.judge_dir + ": case.json: " + e.what());
  }
  const auto name = meta.value("case", std::string());
  std::vector<std::string> sets = conform_case_sets();
  if (fs::exists(a.cases)) sets = {a.cases};
  for (const auto& set : sets)
    for (const auto& c : conform_cases(set))
      if (c.name == name) {
        if (case_json(c, *make_objective(c.objective)) != meta)
          throw InputError(fmt::format("--judge {}: case.json differs from case '{}' as this harness writes it (another "
                                       "version's, or edited): run the case anew with --only {}", a.judge_dir, name,
                                       name));
        return {c};
      }
  throw InputError(fmt::format("--judge {}: case.json names case '{}', which is in no case set{} (a case file's: pass "
                               "it as --cases FILE)", a.judge_dir, name, sets.size() == 1 ? " of " + sets[0] : ""));
}

}  // namespace

int conform_command(const ConformArgs& a, const std::string& command_line) {
  at::set_num_threads(1);  // the harness's side is tiny; the cores are the implementation's
  if (!a.judge_dir.empty()) {
    if (a.impl.empty()) throw InputError("--judge needs --impl: the implementation to run on the case again");
    ConformRun run(a, kept_case(a), command_line);
    return run.run();
  }
  auto cases = select_cases(a);
  if (a.list_cases) {
    print_case_list(cases);
    return 0;
  }
  if (a.impl.empty()) throw InputError("--impl is required (or --list-cases)");
  ConformRun run(a, std::move(cases), command_line);
  return run.run();
}

}  // namespace sbp
