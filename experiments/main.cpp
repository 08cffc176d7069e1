// streambp: the harness's command line. Subcommands: run (one BP step, measured), train (optimizer steps), compare (gradient files),
// demo (the side-by-side of the BP methods), verify (Table 7: low-precision gradient errors), toy (Table 6: the
// two-linear-layer example), sweep (seq/batch/partition measurement sweeps),
// maxlen (the maximum T under a budget), project (the models at the paper's settings),
// reproduce (one table or figure, CPU-scaled),
// profile (the memory timeline of two steps), conform (another implementation's gradients against the oracle).
#include <algorithm>
#include <exception>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "experiments/commands.h"
#include "experiments/provenance.h"
#include "profiler/cpu_meter.h"

namespace {

// Edit distance of two short words (a mistyped command's nearest name).
std::size_t distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const auto above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

bool is_command(const CLI::App& app, const std::string& word) {
  return !app.get_subcommands([&](const CLI::App* sub) { return sub->get_name() == word; }).empty();
}

// "unknown command 'rnu' (did you mean run?); commands: run, train, ..." when the first word names no command.
std::string unknown_command(const CLI::App& app, const std::string& word) {
  std::string names, nearest;
  std::size_t best = 3;  // at most two edits away, or no suggestion
  for (const auto* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    names += (names.empty() ? "" : ", ") + sub->get_name();
    if (const auto d = distance(word, sub->get_name()); d < best) best = d, nearest = sub->get_name();
  }
  return "unknown command '" + word + "'" + (nearest.empty() ? "" : " (did you mean " + nearest + "?)") +
         "; commands: " + names + " (streambp --help)";
}

}  // namespace

int main(int argc, char** argv) {
  // Before any tensor exists, so that every byte is seen (ARCHITECTURE.md §7).
  sbp::CpuMemoryMeter::install();

  CLI::App app{"StreamBP harness: exact, memory-efficient backpropagation for long sequences, next to its baselines"};
  app.require_subcommand(1);
  sbp::RunArgs run_args;
  sbp::TrainArgs train_args;
  sbp::CompareArgs compare_args;
  sbp::DemoArgs demo_args;
  sbp::VerifyArgs verify_args;
  sbp::ToyArgs toy_args;
  sbp::SweepArgs sweep_args;
  sbp::MaxlenArgs maxlen_args;
  sbp::ProjectArgs project_args;
  sbp::ReproduceArgs reproduce_args;
  sbp::ProfileArgs profile_args;
  sbp::ConformArgs conform_args;
  auto* run = app.add_subcommand("run", "one forward + backward of a BP method, measured");
  sbp::add_run_options(*run, run_args);
  auto* train = app.add_subcommand("train", "optimizer steps of a BP method: AdamW/SGD, schedules, clipping, gradient "
                                            "accumulation, resumable checkpoints, per-step metrics");
  sbp::add_train_options(*train, train_args);
  auto* compare = app.add_subcommand("compare", "compare two gradient files tensor by tensor");
  sbp::add_compare_options(*compare, compare_args);
  auto* demo = app.add_subcommand("demo", "side-by-side of the BP methods: peak memory, analytic floor, time, check");
  sbp::add_demo_options(*demo, demo_args);
  auto* verify = app.add_subcommand("verify", "the paper's Table 7: fp32/bf16 gradient errors of each method against "
                                              "base32 and the fp64 oracle, per module group");
  sbp::add_verify_options(*verify, verify_args);
  auto* toy = app.add_subcommand("toy", "the paper's Table 6: the two-linear-layer example, standard vs streamed over D "
                                        "row blocks, in Eigen and LibTorch");
  sbp::add_toy_options(*toy, toy_args);
  auto* sweep = app.add_subcommand("sweep", "a measurement sweep over T (seq), B (batch) or StreamBP's chunk sizes "
                                            "(partition): peak, analytic model, time, check; resumable");
  sbp::add_sweep_options(*sweep, sweep_args);
  auto* maxlen = app.add_subcommand("maxlen", "the maximum sequence length of each method under a byte budget: the "
                                              "model's prediction, confirmed by a run that fits and one that does not");
  sbp::add_maxlen_options(*maxlen, maxlen_args);
  auto* project = app.add_subcommand("project", "the memory models at the paper's Table 3 settings (Qwen3-4B..32B, "
                                                "bf16, 80 GB): projected maximum T beside the paper's");
  sbp::add_project_options(*project, project_args);
  auto* reproduce = app.add_subcommand("reproduce", "the CPU-scaled version of one of the paper's tables or figures, "
                                                    "from checked-in settings (about 30 min each on 2 cores)");
  sbp::add_reproduce_options(*reproduce, reproduce_args);
  auto* profile = app.add_subcommand("profile", "the memory timeline of consecutive steps per method (Fig. 1/8): "
                                                "live bytes by category and phase, CSV + Chrome trace");
  sbp::add_profile_options(*profile, profile_args);
  auto* conform = app.add_subcommand("conform", "check another implementation's gradients against the harness's "
                                                "oracle over a matrix of cases, through a file protocol (exit 1 on "
                                                "any failure)");
  sbp::add_conform_options(*conform, conform_args);
  if (argc > 1 && argv[1][0] != '-' && !is_command(app, argv[1])) {
    fmt::print(stderr, "streambp: error: {}\n", unknown_command(app, argv[1]));
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help prints and exits 0; every rejection of the command line (an unknown flag, a value of the wrong type or
    // out of its range, a missing required option) is bad input: exit 2 like every other, not CLI11's own 105-113.
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }

  const auto command_line = sbp::shell_quote_argv(argc, argv);
  try {
    if (*run) return sbp::run_command(run_args, command_line);
    if (*train) return sbp::train_command(train_args, command_line);
    if (*compare) return sbp::compare_command(compare_args, command_line);
    if (*verify) return sbp::verify_command(verify_args, command_line);
    if (*toy) return sbp::toy_command(toy_args, command_line);
    if (*sweep) return sbp::sweep_command(sweep_args, command_line);
    if (*maxlen) return sbp::maxlen_command(maxlen_args, command_line);
    if (*project) return sbp::project_command(project_args, command_line);
    if (*reproduce) return sbp::reproduce_command(reproduce_args, command_line);
    if (*profile) return sbp::profile_command(profile_args, command_line);
    if (*conform) return sbp::conform_command(conform_args, command_line);
    return sbp::demo_command(demo_args, command_line);
  } catch (const c10::Error& e) {
    fmt::print(stderr, "streambp: error: {}\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    fmt::print(stderr, "streambp: error: {}\n", e.what());
  }
  return 2;
}
