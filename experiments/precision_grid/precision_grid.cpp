// The low-precision rule's statistic, measured (issue #28): for exact methods (StreamBP at 1 to T chunks,
// checkpointing, MsT), every parameter tensor's l2 error against the fp64 oracle on the same weights, beside standard
// BP's in the same dtype, over seeds x models x objectives x full/LoRA x fp32/bf16/bf16-mixed. One CSV row per tensor;
// the CPU configuration (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) is read from the environment this process runs in,
// so precision_grid.sh runs it once per configuration. The rule's allowance is a function of the effective entry count,
// so the rows let the distribution be plotted against it (plots/plot_precision.py) and the rule re-derived.
//   streambp_precision_grid --out FILE.csv [--seeds 20] [--first-seed 0] [--models tiny,d128,small] [--quick]
//                           [--objectives sft,grpo,dpo] [--lora full,lora] [--precisions fp32,bf16,bf16-mixed]
//                           [--methods "SPEC;SPEC"] (instead of the exact methods' list)
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

#include "baselines/methods.h"
#include "core/methods/streaming.h"
#include "core/model/config.h"
#include "core/model/gemm.h"
#include "core/model/lora.h"
#include "core/model/model.h"
#include "core/objectives/batch.h"
#include "core/objectives/objective.h"
#include "experiments/provenance.h"
#include "experiments/results_table.h"
#include "experiments/options.h"
#include "verify/grad_compare.h"
#include "core/io/input_error.h"

namespace {

struct GridModel {
  std::string name;
  sbp::ModelConfig config;
  std::int64_t seq_len;
};

// tiny (d = 64, head_dim 16: the 16-entry q/k norms), issue #18's 4-layer d = 128 model, and two layers of
// qwen3-small's shape (d = 512, I = 1536, 8 x 64 heads over 4 KV heads) with a 2048-token vocabulary. Untied, so that
// the head and the embedding are judged apart.
std::vector<GridModel> grid_models(const std::vector<std::string>& names) {
  std::vector<GridModel> out;
  for (const auto& name : names) {
    sbp::ModelConfig c = sbp::preset_config(name == "small" ? "qwen3-small" : "tiny");
    c.tie_word_embeddings = false;
    std::int64_t T = 512;
    if (name == "d128") {
      c.hidden_size = 128, c.intermediate_size = 256, c.num_hidden_layers = 4, c.head_dim = 32;
    } else if (name == "small") {
      c.num_hidden_layers = 2, c.vocab_size = 2048;
      T = 256;
    } else if (name != "tiny") {
      throw sbp::InputError("--models: unknown model '" + name + "' (tiny, d128, small)");
    }
    c.name = name;
    out.push_back({name, c, T});
  }
  return out;
}

// Exact methods at chunk counts from 1 to T (StreamBP's layer chunks, MsT's mini-sequences).
std::vector<std::string> grid_methods(std::int64_t T, bool quick) {
  std::vector<std::string> specs = {fmt::format("streambp:layer_chunk={},head_chunk={}", T, T),
                                    fmt::format("streambp:layer_chunk={},head_chunk=16", T / 8),
                                    "streambp:layer_chunk=8,head_chunk=64", "checkpoint", "mst:mini_seq=8"};
  if (!quick) {
    specs.push_back("streambp:layer_chunk=1,head_chunk=32");
    specs.push_back(fmt::format("mst:mini_seq={}", T));
  }
  return specs;
}

sbp::TensorList step(sbp::Model& model, const std::string& spec, sbp::Objective& objective, const sbp::Batch& batch) {
  auto method = sbp::make_method(spec);
  method->step(model, objective, batch);
  sbp::TensorList out;
  for (const auto& g : model.gradients()) out.push_back({g.name, g.tensor.to(at::kDouble)});
  model.zero_grad();
  return out;
}

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : "native";
}

}  // namespace

int main(int argc, char** argv) {
  if (const auto note = sbp::coherent_cpu_configuration(); !note.empty()) std::fprintf(stderr, "%s\n", note.c_str());
  std::string out_path, models = "tiny,d128,small", objective_names = "sft,grpo,dpo", loras = "full,lora",
              precisions = "fp32,bf16,bf16-mixed", methods;
  int seeds = 20, first_seed = 0;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw sbp::InputError(a + " needs a value");
      return argv[++i];
    };
    if (a == "--out") out_path = value();
    else if (a == "--seeds") seeds = std::stoi(value());
    else if (a == "--first-seed") first_seed = std::stoi(value());
    else if (a == "--objectives") objective_names = value();
    else if (a == "--lora") loras = value();
    else if (a == "--precisions") precisions = value();
    else if (a == "--methods") methods = value();
    else if (a == "--models") models = value();
    else if (a == "--quick") quick = true;
    else {
      std::fprintf(stderr, "usage: %s --out FILE.csv [--seeds N] [--first-seed S] [--models tiny,d128,small] [--quick] "
                   "[--objectives sft,grpo,dpo] [--lora full,lora] [--precisions fp32,bf16,bf16-mixed] "
                   "[--methods 'SPEC;SPEC']\n", argv[0]);
      return 2;
    }
  }
  if (out_path.empty() || std::filesystem::exists(out_path)) {
    std::fprintf(stderr, "error: --out must name a new file\n");
    return 2;
  }
  at::set_num_threads(1);
  // The configuration: both knobs and the bf16 GEMM paths this process chose (core/model/gemm.h), e.g.
  // "aten=native;onednn=AVX2;gemm=nt:widened|nn:widened|tn:widened".
  std::string paths = sbp::gemm_paths(at::kBFloat16).describe();
  for (auto& ch : paths) ch = ch == ',' ? '|' : ch == '=' ? ':' : ch;
  const std::string cpu = "aten=" + env("ATEN_CPU_CAPABILITY") + ";onednn=" + env("ONEDNN_MAX_CPU_ISA") + ";gemm=" + paths;
  const std::string tmp = out_path + ".tmp";
  std::ofstream csv(tmp);
  csv << "cpu_config,model,objective,lora,precision,seed,seq_len,method,tensor,group,numel,effective_entries,"
         "method_l2,standard_l2,method_l2_beside_scale,standard_l2_beside_scale,floor,allowance,statistic,"
         "method_scale,standard_run_error,scale_allowance,scale_statistic\n";
  const std::map<std::string, std::pair<std::string, std::int64_t>> known_objectives = {
      {"sft", {"sft", 0}}, {"grpo", {"grpo:beta=0.04,loss_type=grpo", 2}}, {"dpo", {"dpo:beta=0.1", 0}}};
  std::vector<std::pair<std::string, std::int64_t>> objectives;
  for (const auto& name : sbp::split_list(objective_names, ',')) objectives.push_back(known_objectives.at(name));
  std::size_t done = 0;
  for (const auto& m : grid_models(sbp::split_list(models, ',')))
    for (const auto& [objective_spec, group] : objectives)
      for (const auto& lora_name : sbp::split_list(loras, ','))
        for (int seed = first_seed; seed < first_seed + seeds; ++seed) {
          const std::string lora = lora_name == "lora" ? "rank=8,init=random" : "";
          auto objective = sbp::make_objective(objective_spec);
          sbp::Model bf16(m.config, at::kBFloat16, 1000 + seed);
          sbp::Model oracle_model(m.config, at::kDouble, bf16.parameters(), "bf16 weights");
          if (!lora.empty()) {
            bf16.add_lora(sbp::parse_lora_spec(lora), 2000 + seed);
            oracle_model.load_lora(bf16.lora(), bf16.adapters(), "bf16 adapters");
          }
          // B = 2: two SFT rows (20% prompt), one GRPO group of two completions, one DPO pair.
          sbp::Batch batch = objective->random_batch(m.config, {2, m.seq_len, 0.0, 0.2, std::uint64_t(3000 + seed), group});
          if (objective->wants_policy_logps())
            objective->add_synthetic_logps(batch, sbp::sequence_logps(oracle_model, batch, objective->temperature()),
                                           std::uint64_t(3000 + seed), false);
          const auto oracle = step(oracle_model, "standard", *objective, batch);
          for (const auto& precision : sbp::split_list(precisions, ',')) {
            sbp::Model model = precision == "fp32" ? sbp::Model(m.config, at::kFloat, bf16.parameters(), "bf16 weights")
                                                   : sbp::Model(m.config, at::kBFloat16, bf16.parameters(), "bf16 weights");
            if (!lora.empty()) model.load_lora(bf16.lora(), bf16.adapters(), "bf16 adapters");
            if (precision == "bf16-mixed") model.set_grad_dtype(at::kFloat);
            const auto dtype = precision == "fp32" ? at::kFloat : at::kBFloat16;
            const auto standard = sbp::compare_gradients(oracle, step(model, "standard", *objective, batch));
            for (const auto& spec : methods.empty() ? grid_methods(m.seq_len, quick) : sbp::split_list(methods, ';')) {
              const auto method = sbp::compare_gradients(oracle, step(model, spec, *objective, batch));
              // The rule's two parts (verify/grad_compare.h): each tensor beside the run's common scale, and the scale.
              const auto verdict = sbp::low_precision_rule(standard, method, dtype);
              const auto& scale = verdict.scale;
              for (std::size_t t = 0; t < method.tensors.size(); ++t) {
                const auto& e = method.tensors[t];
                const auto& j = verdict.tensors[t];
                csv << fmt::format("{},{},{},{},{},{},{},{},{},{},{},{:.1f},{:.6e},{:.6e},{:.6e},{:.6e},{:.6e},{:.4f},{:.4f},"
                                   "{:.6e},{:.6e},{:.4f},{:.4f}\n", cpu,
                                   m.name, objective_spec.substr(0, objective_spec.find(':')),
                                   lora.empty() ? "full" : "lora", precision, seed, m.seq_len,
                                   "\"" + spec + "\"", e.name, e.group, e.numel, j.effective_entries, e.l2_rel,
                                   standard.tensors[t].l2_rel, j.method_error, j.standard_error, j.floor, j.allowance,
                                   j.statistic, scale.method_error, scale.standard_error, scale.allowance,
                                   scale.statistic);
              }
            }
          }
          std::fprintf(stderr, "\r%s %s %s seed %d (%zu cases)   ", m.name.c_str(), objective_spec.c_str(),
                       lora.empty() ? "full" : "lora", seed, ++done);
        }
  csv.close();
  std::filesystem::rename(tmp, out_path);
  std::ofstream sidecar(out_path + ".json");
  std::string command;
  for (int i = 0; i < argc; ++i) command += (i ? " " : "") + std::string(argv[i]);
  sidecar << sbp::to_json(sbp::collect_provenance(command)).dump(2) << "\n";
  std::fprintf(stderr, "\nwrote %s\n", out_path.c_str());
  return 0;
}
