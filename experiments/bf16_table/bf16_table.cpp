// The bf16 table (issue #18 item 3): per-tensor l2 errors of StreamBP (and other methods) against the fp64 oracle on
// the same bf16 weights, divided by standard-bf16's error on the same tensor (CMake target streambp_bf16_table; run
// by bf16_table.sh).
//   streambp_bf16_table MODEL LORA MIXED SPEC...   MODEL: preset name or config.json; LORA: "-" or a LoRA spec; MIXED: 0/1
// Prints per spec a RESULT line: the worst ratio over non-degenerate tensors, that tensor, and the harness's
// low-precision rule's verdict on the run (verify/grad_compare.h low_precision_rule: its statistic, <= 1 passes, and
// where it is worst); with --all, every tensor's errors before it.
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "baselines/methods.h"
#include "core/model/gemm.h"
#include "core/objectives/batch.h"
#include "core/model/config.h"
#include "core/model/lora.h"
#include "core/model/model.h"
#include "core/objectives/sft.h"
#include "verify/grad_compare.h"

namespace {

// Optional overrides for exploring other draws: BF16_TABLE_SEED (weights seed; the batch's is seed + 1),
// BF16_TABLE_TIED=1 (keep the config's tying), BF16_TABLE_PROMPT (prompt fraction of the batch),
// BF16_TABLE_THREADS (intra-op threads, default 1), BF16_TABLE_BATCH (rows), BF16_TABLE_BATCH_SEED.
double env_or(const char* name, double fallback) {
  const char* v = std::getenv(name);
  return v ? std::atof(v) : fallback;
}

sbp::TensorList step(sbp::Model& model, const std::string& spec, const sbp::Batch& batch) {
  auto method = sbp::make_method(spec);
  sbp::SftObjective objective;
  method->step(model, objective, batch);
  sbp::TensorList out;
  for (const auto& g : model.gradients()) out.push_back({g.name, g.tensor.clone()});
  model.zero_grad();
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (const auto note = sbp::coherent_cpu_configuration(); !note.empty()) std::fprintf(stderr, "%s\n", note.c_str());
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s MODEL LORA MIXED [--all] SPEC...\n", argv[0]);
    return 2;
  }
  at::set_num_threads(int(env_or("BF16_TABLE_THREADS", 1)));
  const std::string model_arg = argv[1], lora = argv[2];
  const bool mixed = std::string(argv[3]) == "1";
  bool all = false;
  std::vector<std::string> specs;
  for (int i = 4; i < argc; ++i) {
    if (std::string(argv[i]) == "--all") all = true;
    else specs.push_back(argv[i]);
  }
  sbp::ModelConfig config = std::filesystem::exists(model_arg) ? sbp::read_config_json(model_arg)
                                                               : sbp::preset_config(model_arg);
  if (env_or("BF16_TABLE_TIED", 0) == 0) config.tie_word_embeddings = false;  // as the bf16 tests (bf16_errors)
  const auto seed = std::uint64_t(env_or("BF16_TABLE_SEED", 17));
  // BF16_TABLE_FP32=1: the same table for an fp32 model on the same (bf16-rounded) weights.
  sbp::Model model(config, at::kBFloat16, seed);
  if (env_or("BF16_TABLE_FP32", 0) != 0) model = sbp::Model(config, at::kFloat, model.parameters(), "bf16 weights");
  sbp::Model oracle_model(config, at::kDouble, model.parameters(), "bf16 weights");
  if (lora != "-") {
    model.add_lora(sbp::parse_lora_spec(lora), 19);
    oracle_model.load_lora(model.lora(), model.adapters(), "bf16 adapters");
  }
  if (mixed) model.set_grad_dtype(at::kFloat);
  const sbp::Batch batch = sbp::random_sft_batch(config, {std::int64_t(env_or("BF16_TABLE_BATCH", 1)), 512, 0.0, env_or("BF16_TABLE_PROMPT", 0.0),
                                                     std::uint64_t(env_or("BF16_TABLE_BATCH_SEED", double(seed + 1)))});
  const auto oracle = step(oracle_model, "standard", batch);
  const auto standard = sbp::compare_gradients(oracle, step(model, "standard", batch));
  for (const auto& spec : specs) {
    const auto method = sbp::compare_gradients(oracle, step(model, spec, batch));
    double worst = 0;
    std::string worst_name;
    double worst_m = 0, worst_s = 0;
    // The one low-precision rule, as conform, verify --gate and the tests judge (no copy of it here).
    const auto rule = sbp::low_precision_rule(standard, method, model.dtype());
    for (std::size_t i = 0; i < method.tensors.size(); ++i) {
      const auto& m = method.tensors[i];
      const auto& s = standard.tensors[i];
      if (all)
        std::printf("  %-55s std %.3e  method %.3e  ratio %.3f  rule %.3f%s\n", m.name.c_str(), s.l2_rel, m.l2_rel,
                    m.l2_rel / s.l2_rel, rule.tensors[i].statistic, s.degenerate ? " (degenerate)" : "");

      if (s.degenerate) continue;
      const double r = m.l2_rel / s.l2_rel;
      if (r > worst) worst = r, worst_name = m.name, worst_m = m.l2_rel, worst_s = s.l2_rel;
    }
    std::printf("RESULT model=%s lora=%s mixed=%d spec=%s worst_ratio=%.3f tensor=%s method=%.3e standard=%.3e "
                "rule=%.3f rule_tensor=%s\n",
                config.name.c_str(), lora.c_str(), int(mixed), spec.c_str(), worst, worst_name.c_str(), worst_m,
                worst_s, rule.worst_ratio, rule.worst_tensor.c_str());
    std::fflush(stdout);
  }
  return 0;
}
