// streambp: the harness's command line. The commands are the table in command_table(); each one's options and work
// are in experiments/cmd_<name>.cpp. Exit codes: experiments/exit_status.h (bad input 2, out of memory 3, a bug 70).
#include <algorithm>
#include <csignal>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "core/io/process_exit.h"
#include "core/io/spec.h"
#include "experiments/commands.h"
#include "experiments/exit_status.h"
#include "experiments/provenance.h"
#include "core/model/gemm.h"
#include "profiler/cpu_meter.h"

namespace {

bool is_command(const CLI::App& app, const std::string& word) {
  return !app.get_subcommands([&](const CLI::App* sub) { return sub->get_name() == word; }).empty();
}

// "unknown command 'rnu' (did you mean run?); commands: run, train, ..." when the first word names no command.
std::string unknown_command(const CLI::App& app, const std::string& word) {
  std::string names;
  std::vector<std::string> candidates;
  for (const auto* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    names += (names.empty() ? "" : ", ") + sub->get_name();
    candidates.push_back(sub->get_name());
  }
  const auto nearest = sbp::nearest_name(word, candidates);
  return "unknown command '" + word + "'" + (nearest.empty() ? "" : " (did you mean " + nearest + "?)") +
         "; commands: " + names + " (streambp --help)";
}

// "unknown option '--presett' (did you mean --preset?)" for the first --word of argv that names no option of the
// command `sub` (or of `app` before it): CLI11 would only list it among the arguments it did not expect. "" when
// every --word is an option.
std::string unknown_option(const CLI::App& app, const CLI::App& sub, int argc, char** argv) {
  std::vector<std::string> names;
  for (const auto* scope : {&app, &sub})
    for (const auto* option : scope->get_options())
      for (const auto& name : option->get_lnames()) names.push_back("--" + name);
  for (int i = 1; i < argc; ++i) {
    const std::string word = argv[i];
    if (word == "--") break;  // what follows is a value, whatever it looks like
    if (word.rfind("--", 0) != 0) continue;
    const auto flag = word.substr(0, word.find('='));
    if (std::find(names.begin(), names.end(), flag) != names.end()) continue;
    const auto nearest = sbp::nearest_name(flag, names);
    return "unknown option '" + flag + "'" + (nearest.empty() ? "" : " (did you mean " + nearest + "?)") + " for " +
           sub.get_name() + " (streambp " + sub.get_name() + " --help lists them)";
  }
  return {};
}

// One command of the CLI: its name, its one-line help, and how it attaches its typed options to its subcommand,
// which gives back the function that runs it on the parsed options.
using Runner = std::function<int(const std::string& command_line)>;
struct Command {
  const char* name;
  const char* help;
  std::function<Runner(CLI::App&)> attach;
};

template <typename Args>
Command command(const char* name, const char* help, void (*add_options)(CLI::App&, Args&),
                int (*run)(const Args&, const std::string&)) {
  return {name, help, [add_options, run](CLI::App& sub) -> Runner {
            auto args = std::make_shared<Args>();
            add_options(sub, *args);
            return [args, run](const std::string& command_line) { return run(*args, command_line); };
          }};
}

// Every command, in the order of `streambp --help`. A new command is a cmd_<name>.cpp and one line here.
std::vector<Command> command_table() {
  using namespace sbp;
  return {
      command("run", "one forward + backward of a BP method, measured", add_run_options, run_command),
      command("train", "optimizer steps of a BP method: AdamW/SGD, schedules, clipping, gradient accumulation, "
              "resumable checkpoints, per-step metrics", add_train_options, train_command),
      command("compare", "compare two gradient files tensor by tensor", add_compare_options, compare_command),
      command("demo", "side-by-side of the BP methods: peak memory, analytic floor, time, check", add_demo_options,
              demo_command),
      command("verify", "the paper's Table 7: fp32/bf16 gradient errors of each method against base32 and the fp64 "
              "oracle, per module group", add_verify_options, verify_command),
      command("toy", "the paper's Table 6: the two-linear-layer example, standard vs streamed over D row blocks, in "
              "Eigen and LibTorch", add_toy_options, toy_command),
      command("sweep", "a measurement sweep over T (seq), B (batch) or StreamBP's chunk sizes (partition): peak, "
              "analytic model, time, check; resumable", add_sweep_options, sweep_command),
      command("maxlen", "the maximum sequence length of each method under a byte budget: the model's prediction, "
              "confirmed by a run that fits and one that does not", add_maxlen_options, maxlen_command),
      command("project", "the memory models at the paper's Table 3 settings (Qwen3-4B..32B, bf16, 80 GB): projected "
              "maximum T beside the paper's", add_project_options, project_command),
      command("reproduce", "the CPU-scaled version of one of the paper's tables or figures, from checked-in settings "
              "(about 30 min each on 2 cores)", add_reproduce_options, reproduce_command),
      command("profile", "the memory timeline of consecutive steps per method (Fig. 1/8): live bytes by category and "
              "phase, CSV + Chrome trace", add_profile_options, profile_command),
      command("pack-gain", "one method on packed rows against the same sequences padded to the longest: time, "
              "peak and tokens per second of each layout", add_pack_gain_options, pack_gain_command),
      command("conform", "check another implementation's gradients against the harness's oracle over a matrix of "
              "cases, through a file protocol (exit 1 on any failure)", add_conform_options, conform_command),
      command("rl-step", "the whole-RL-step oracle: a GRPO trainer's step from a case's generations and rewards to the "
              "gradient at each optimizer step, fp64 (docs/rl-steps.md)", add_rl_step_options, rl_step_command),
      command("gemm-path", "this machine's bf16 GEMM path per layout, measured once and stored in the cache folder; "
              "--remeasure measures again", add_gemm_path_options, gemm_path_command),
  };
}

int run_main(int argc, char** argv) {
  // Before any tensor exists, so that every byte is seen (ARCHITECTURE.md §7).
  sbp::CpuMemoryMeter::install();
  // A file-size limit (ulimit -f) is a write that fails naming its file (the offload tier's, a result's), not a kill.
  std::signal(SIGXFSZ, SIG_IGN);
  // A lowered ATen capability on an AMX CPU: oneDNN capped to match, before either reads its knob (core/model/gemm.h).
  if (const auto note = sbp::coherent_cpu_configuration(); !note.empty()) fmt::print(stderr, "{}\n", note);

  CLI::App app{"StreamBP harness: exact, memory-efficient backpropagation for long sequences, next to its baselines"};
  app.require_subcommand(1);
  // A rejected command line reads as every other input error does (tests check the class of an exit 2's message).
  const std::string help = argc > 1 && argv[1][0] != '-' ? fmt::format("streambp {} --help", argv[1]) : "streambp --help";
  app.failure_message([help](const CLI::App*, const CLI::Error& e) {
    return fmt::format("streambp: error: {}\nRun `{}` for more information.\n", e.what(), help);
  });
  std::vector<std::pair<CLI::App*, Runner>> commands;
  for (const auto& c : command_table()) {
    auto* sub = app.add_subcommand(c.name, c.help);
    commands.emplace_back(sub, c.attach(*sub));
  }
  if (argc > 1 && argv[1][0] != '-' && !is_command(app, argv[1])) {
    fmt::print(stderr, "streambp: error: {}\n", unknown_command(app, argv[1]));
    return sbp::kExitInput;
  }
  const auto command_line = sbp::shell_quote_argv(argc, argv);
  // Parsing too: a value parsed once CLI11 has accepted the command line (Setup's --device, --lora) throws InputError.
  return sbp::run_with_exit_status([&] {
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      // --help prints and exits 0; every rejection of the command line (an unknown flag, a value of the wrong type or
      // out of its range, a missing required option) is bad input: exit 2 like every other, not CLI11's own 105-113.
      // An unknown flag of any command is named first, with the nearest one (as a mistyped command is above).
      for (const auto& [sub, run] : commands)
        if (argc > 1 && sub->get_name() == argv[1] && e.get_exit_code() != 0)
          if (const auto unknown = unknown_option(app, *sub, argc, argv); !unknown.empty()) {
            fmt::print(stderr, "streambp: error: {}\n", unknown);
            return int(sbp::kExitInput);
          }
      const int code = app.exit(e);
      return code == 0 ? 0 : int(sbp::kExitInput);
    }
    for (const auto& [sub, run] : commands)
      if (sub->parsed()) return run(command_line);
    return int(sbp::kExitInput);  // require_subcommand(1): not reached
  });
}

}  // namespace

// Every local of run_main destroyed, the process ends without libtorch's static teardown (core/io/process_exit.h).
int main(int argc, char** argv) { sbp::exit_without_teardown(run_main(argc, argv)); }
