// `streambp project`: the analytic memory models evaluated at the paper's Table 3 settings (Qwen3-4B/8B/14B/32B,
// bf16, batch 1, layer partition 500 and logits partition 100, LoRA rank 32 in mixed precision, one 80 GB GPU): the
// largest T whose modelled peak fits, per method, beside the paper's measured maximum. These are projections of the
// CPU-measured models (held to a few percent of the CPU meter on small models), not GPU measurements: a GPU run also
// holds the CUDA context, the caching allocator's fragmentation and the kernels' workspaces, which the models leave
// out. SFT only: the paper's GRPO and DPO rows are for column sets it does not label unambiguously.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "baselines/methods.h"
#include "core/config.h"
#include "experiments/commands.h"
#include "experiments/results_table.h"

namespace sbp {
namespace {

struct Setting {
  const char* preset;
  bool lora;
  double standard, checkpoint, streambp;  // the paper's Table 3, SFT, thousands of tokens
};
// Table 3 (SFT): baseline without checkpointing, with checkpointing, StreamBP.
constexpr Setting kSettings[] = {{"qwen3-4b", false, 7.0, 28.5, 200.0},  {"qwen3-4b", true, 7.1, 36.5, 247.0},
                                 {"qwen3-8b", false, 3.4, 15.7, 72.0},   {"qwen3-8b", true, 5.1, 30.6, 142.4},
                                 {"qwen3-14b", true, 2.9, 23.0, 84.6},   {"qwen3-32b", true, 0.4, 5.9, 16.3}};

// The workload of a Table 3 run: bf16, batch 1, SFT; LoRA: rank r on all linear layers, fp32 adapters (mixed
// precision, as PEFT keeps them) on a frozen bf16 base.
Workload paper_workload(const ModelConfig& c, bool lora, std::int64_t rank) {
  Workload w;
  w.config = c;
  w.dtype = c10::kBFloat16;
  w.threads = 1;  // the CPU kernels' per-thread scratch is not a GPU term
  if (lora) {
    const auto d = c.hidden_size, q = c.q_width(), kv = c.kv_width(), I = c.intermediate_size;
    w.lora_rank = rank;
    w.lora_parameters = c.num_hidden_layers * rank * ((d + q) + 2 * (d + kv) + (q + d) + 2 * (d + I) + (I + d));
    w.lora_attention_targets = 4;
    w.lora_mlp_targets = 3;
    w.grad_dtype = c10::kFloat;
  }
  return w;
}

// The largest T in [1, hi] whose modelled peak fits the budget (0 if none).
std::int64_t model_max_seq(const BackpropMethod& method, Workload w, std::int64_t budget, std::int64_t hi) {
  auto fits = [&](std::int64_t T) {
    w.seq_len = T;
    return method.memory_model(w).total_bytes() <= budget;
  };
  if (!fits(1)) return 0;
  std::int64_t lo = 1;
  if (fits(hi)) return hi;
  while (hi - lo > 1) {
    const auto mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

}  // namespace

void add_project_options(CLI::App& app, ProjectArgs& a) {
  app.add_option("--budget-bytes", a.budget_bytes, "device memory (default 80e9: the A800's 80 GB)")->check(CLI::PositiveNumber);
  app.add_option("--lora-rank", a.lora_rank, "LoRA rank of the paper's LoRA columns")->check(CLI::PositiveNumber);
  app.add_option("--out", a.out_dir, "results folder");
}

int project_command(const ProjectArgs& a, const std::string& command_line) {
  const std::vector<std::pair<std::string, std::string>> methods = {
      {"standard", "standard"}, {"checkpoint", "checkpoint"}, {"streambp", "streambp:layer_chunk=500,head_chunk=100"}};
  ResultsTable table({"objective", "lora", "batch_size", "budget_bytes", "model_max_seq", "paper_max_seq",
                      "model_over_paper"});
  fmt::print("Table 3 (SFT), projected by the analytic memory models: maximum T under {:.0f} GB, bf16, B = 1\n\n",
             double(a.budget_bytes) / 1e9);
  fmt::print("| model | method | projected T* | paper T* | projected / paper |\n|---|---|---|---|---|\n");
  for (const auto& s : kSettings) {
    const auto config = preset_config(s.preset);
    const auto w = paper_workload(config, s.lora, a.lora_rank);
    const std::string name = std::string(s.preset) + (s.lora ? " LoRA" : " full");
    for (const auto& [label, spec] : methods) {
      const double paper = 1000 * (label == "standard" ? s.standard : label == "checkpoint" ? s.checkpoint : s.streambp);
      auto method = make_method(spec);
      const auto T = model_max_seq(*method, w, a.budget_bytes, std::int64_t(1) << 24);
      fmt::print("| {} | {} | {:.1f}k | {:.1f}k | {:.2f} |\n", name, method->spec(), T / 1000.0, paper / 1000.0, T / paper);
      table.add({s.preset, method->spec(), s.lora ? "bf16-mixed" : "bf16", "projection", 0,
                 {"sft", s.lora ? fmt::format("rank={},targets=all-linear", a.lora_rank) : "", "1",
                  std::to_string(a.budget_bytes), std::to_string(T), fmt::format("{:.0f}", paper),
                  fmt::format("{:.4f}", T / paper)}});
    }
  }
  const auto csv = table.write(a.out_dir, "project", collect_provenance(command_line));
  fmt::print("\nresults: {}\n", csv.string());
  return 0;
}

}  // namespace sbp
