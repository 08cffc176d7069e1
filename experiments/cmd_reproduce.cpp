// `streambp reproduce TABLE`: the CPU-scaled version of one of the paper's tables or figures, from the settings
// checked in below. Each runs this binary's own drivers (so every result's sidecar records the exact command that
// made it) and fits in about 30 minutes on 2 cores; the scale-down is stated next to each, and the paper's full
// settings are in results/README.md.
#include <cstdlib>
#include <stdexcept>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <unistd.h>

#include "experiments/commands.h"
#include "core/io/input_error.h"

namespace sbp {
namespace {

struct Reproduction {
  const char* name;
  const char* paper;       // what the paper shows, and its setting
  const char* scale_down;  // what differs here
  std::vector<std::string> commands;  // arguments of this binary, one run each
};

// The memory grid's methods: every method at its defaults, and StreamBP with chunks that split tiny's short sequences.
const std::string kGridMethods = "standard;checkpoint;mst;streambp;streambp:layer_chunk=500,head_chunk=100";
const std::string kGridMethodsTiny = "standard;checkpoint;mst:mini_seq=64;streambp;streambp:layer_chunk=128,head_chunk=64";
// One run per point, no gradient check (the exactness tests cover these shapes), a budget that turns the largest
// standard/checkpoint points into oom rows instead of filling the machine.
const std::string kGridTail = " --repeats 1 --check-seq 0 --budget-bytes 12884901888 --out results/grid";

const std::vector<Reproduction>& reproductions() {
  static const std::vector<Reproduction> table = {
      {"table1", "Table 1: BP seconds of checkpointing, MsT, StreamBP; Qwen3-4B bf16, T = 6k..27k, A800",
       "qwen3-small (103 M parameters) fp32 on 2 CPU cores, T = 2048..6144; times as ratios to checkpointing",
       {"sweep seq --preset qwen3-small --seq 2048,4096,6144 --methods checkpoint;mst;streambp --repeats 1 "
        "--check-seq 300 --out results/table1"}},
      {"table2", "Table 2: per-sample BP seconds vs batch size 1..16; Qwen3-4B, T = 9000",
       "qwen3-small fp32, T = 2048, B = 1, 2, 4",
       {"sweep batch --preset qwen3-small --seq 2048 --batch 1,2,4 --methods checkpoint;mst;streambp --repeats 1 "
        "--check-seq 0 --out results/table2"}},
      {"table3", "Table 3 / Fig. 4: maximum T under 80 GB; Qwen3-4B..32B bf16, SFT/GRPO/DPO, full and LoRA",
       "qwen3-small fp32 SFT under a 1.125 GiB budget (measured, 2% resolution), and the memory models' projection "
       "to the paper's models and 80 GB",
       {"maxlen --preset qwen3-small --budget-bytes 1207959552 --methods checkpoint;mst;streambp:layer_chunk=500,head_chunk=100 "
        "--out results/table3",
        "project --out results/projection"}},
      {"table6", "Table 6: the two-linear-layer example, X 1e6 x 16384, D = 20..500",
       "X 16384 x 1024 in fp32, D = 1..1024, Eigen (1 thread) and LibTorch",
       {"toy --rows 16384 --dim 1024 --partitions 1,4,16,64,256,1024 --repeats 3 --out results/table6"}},
      {"table7", "Table 7: Er_abs / Er_rel of base16, stream16, stream32 against base32; Qwen3-8B",
       "qwen3-small, T = 1024, SFT, against base32 and the fp64 oracle, with checkpointing, MsT and mixed precision",
       {"verify --preset qwen3-small --seq 1024 --methods streambp:layer_chunk=128,head_chunk=128;checkpoint;mst "
        "--mixed --gate --out results/table7"}},
      {"fig3", "Fig. 3: peak BP memory vs T, with and without checkpointing; Qwen3-8B/14B/32B",
       "qwen3-small fp32, T = 1024..4096, every method, measured peak beside the analytic model",
       {"sweep seq --preset qwen3-small --seq 1024,2048,4096 --methods standard;checkpoint;mst;streambp --repeats 1 "
        "--check-seq 300 --out results/fig3"}},
      {"fig5", "Fig. 5: time and memory vs partition size (1k/2k/5k/T3); Qwen3-4B",
       "qwen3-small fp32, T = 4096, layer chunks 256..1366 x head chunks 256 and 1024",
       {"sweep partition --preset qwen3-small --seq 4096 --layer-chunks 256,512,1024,1366 --head-chunks 256,1024 "
        "--repeats 1 --check-seq 0 --out results/fig5"}},
      {"memory-grid", "(not a paper table) the analytic memory models against the meter: the error bars of `project`",
       "tiny and qwen3-small (GQA and their -mha twins), qwen3-0.6b; T = 64..16384, B = 1..8, fp32, bf16, bf16-mixed "
       "and LoRA; every method; one run per point, no timing claims (--repeats 1), over-budget points recorded as oom",
       {"sweep seq --preset tiny --seq 64,256,1024,4096 --batch 1,8 --methods " + kGridMethodsTiny + kGridTail,
        "sweep seq --preset tiny --seq 16384 --batch 1,8 --methods standard;checkpoint;mst;streambp" + kGridTail,
        "sweep seq --preset tiny --dtype bf16 --seq 64,1024,4096 --batch 1,8 --methods " + kGridMethodsTiny + kGridTail,
        "sweep seq --preset tiny-mha --seq 64,1024,4096 --batch 1,8 --methods " + kGridMethodsTiny + kGridTail,
        "sweep seq --preset tiny-mha --dtype bf16 --seq 64,1024,4096 --batch 1,8 --methods " + kGridMethodsTiny + kGridTail,
        "sweep seq --preset tiny --lora rank=8 --seq 64,1024,4096 --batch 1,4 --methods " + kGridMethodsTiny + kGridTail,
        "sweep seq --preset tiny --dtype bf16 --grad-dtype fp32 --lora rank=8 --seq 64,1024,4096 --batch 1,4 --methods " +
            kGridMethodsTiny + kGridTail,
        "sweep seq --preset qwen3-small --seq 64,512,2048,8192 --methods " + kGridMethods + kGridTail,
        "sweep seq --preset qwen3-small --seq 256,1024 --batch 4,8 --methods " + kGridMethods + kGridTail,
        "sweep seq --preset qwen3-small --dtype bf16 --seq 64,512,2048 --methods " + kGridMethods + kGridTail,
        "sweep seq --preset qwen3-small-mha --seq 512,4096 --methods " + kGridMethods + kGridTail,
        "sweep seq --preset qwen3-0.6b --seq 64,1024,2048 --methods " + kGridMethods + kGridTail}},
  };
  return table;
}

// "a b;c d" -> argv: split on spaces (no argument here contains one).
std::vector<std::string> words(const std::string& command) {
  std::vector<std::string> out;
  std::string word;
  for (const char c : command + " ")
    if (c == ' ') {
      if (!word.empty()) out.push_back(word);
      word.clear();
    } else {
      word += c;
    }
  return out;
}

std::string self_path() {
  char buf[4096];
  const auto n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw std::runtime_error("reproduce: cannot find this binary (/proc/self/exe)");
  return std::string(buf, std::size_t(n));
}

std::string quote(const std::string& s) {
  std::string q = "'";
  for (const char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

}  // namespace

void add_reproduce_options(CLI::App& app, ReproduceArgs& a) {
  std::string names;
  std::vector<std::string> choices;
  for (const auto& r : reproductions()) choices.push_back(r.name), names += std::string(names.empty() ? "" : ", ") + r.name;
  app.add_option("table", a.table, "which: " + names)->required()->check(CLI::IsMember(choices));
  app.add_flag("--dry-run", a.dry_run, "print the commands, run nothing");
  app.add_option("--threads", a.threads, "intra-op threads for every run (default: torch's)")->check(CLI::NonNegativeNumber);
}

int reproduce_command(const ReproduceArgs& a, const std::string&) {
  const Reproduction* r = nullptr;
  for (const auto& x : reproductions())
    if (a.table == x.name) r = &x;
  if (!r) throw InputError("unknown table '" + a.table + "'");
  fmt::print("{}\n  paper:      {}\n  here:       {}\n", r->name, r->paper, r->scale_down);
  const auto self = self_path();
  for (const auto& command : r->commands) {
    std::string line = quote(self);
    for (const auto& w : words(command)) line += " " + quote(w);
    if (a.threads > 0 && command.rfind("project", 0) != 0) line += " --threads " + std::to_string(a.threads);
    fmt::print("  command:    {}\n", line);
    std::fflush(stdout);
    if (a.dry_run) continue;
    const int status = std::system(line.c_str());
    if (status != 0) {
      fmt::print(stderr, "reproduce {}: the command above failed (status {})\n", r->name, status);
      return 1;
    }
  }
  return 0;
}

}  // namespace sbp
