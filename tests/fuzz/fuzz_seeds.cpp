// Writes the seed corpus of every fuzz target, made by the harness's own writers (the files its tests and users
// write): fuzz_seeds DIR -> DIR/<target>/<seed>. A target's corpus starts from valid inputs, so that the fuzzer
// spends its time on the checks behind the first ones rather than on rediscovering the format.
#include <ATen/ATen.h>

#include <fstream>
#include <iostream>

#include "baselines/methods.h"
#include "core/model/checkpoint_io.h"
#include "core/io/safetensors.h"
#include "core/model/config.h"
#include "core/model/lora.h"
#include "core/model/model.h"
#include "core/objectives/objective.h"
#include "core/training/trainer.h"
#include "experiments/results_table.h"
#include "experiments/batches.h"
#include "tests/fuzz/fuzz_support.h"

namespace {

namespace fs = std::filesystem;
using sbp::fuzz::join_parts;

std::string slurp(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void seed(const fs::path& dir, const std::string& target, const std::string& name, const std::string& bytes) {
  fs::create_directories(dir / target);
  std::ofstream(dir / target / name, std::ios::binary) << bytes;
}

// One small tensor of every dtype the format has, a scalar and an empty tensor, with metadata.
sbp::TensorList every_dtype() {
  sbp::TensorList t;
  for (const auto type : {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16, at::kLong, at::kInt, at::kShort, at::kChar,
                          at::kByte, at::kBool})
    t.push_back({std::string("t_") + c10::toString(type), at::arange(2).to(type)});
  t.push_back({"scalar", at::scalar_tensor(1.5, at::kFloat)});
  t.push_back({"empty", at::zeros({0, 3}, at::kFloat)});
  return t;
}

std::string file_of(const sbp::TensorList& tensors, const std::map<std::string, std::string>& metadata = {}) {
  const auto file = sbp::fuzz::scratch() / "seed.safetensors";
  sbp::write_safetensors(file, tensors, metadata);
  return slurp(file);
}

// An HF folder as written by write_safetensors_dir: index then shards in name order.
std::string sharded(const sbp::TensorList& tensors, std::uint64_t shard_bytes) {
  const auto dir = sbp::fuzz::scratch() / "sharded";
  fs::remove_all(dir);
  sbp::write_safetensors_dir(dir, tensors, shard_bytes, {{"format", "pt"}});
  std::vector<std::string> parts = {slurp(dir / "model.safetensors.index.json")};
  std::set<fs::path> shards;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") shards.insert(e.path());
  for (const auto& s : shards) parts.push_back(slurp(s));
  return join_parts(parts);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: fuzz_seeds DIR\n";
    return 2;
  }
  const fs::path out = argv[1];
  const sbp::ModelConfig config = sbp::fuzz::micro_config();
  sbp::Model model(config, at::kBFloat16, 1);
  sbp::TensorList weights;
  for (const auto& p : model.parameters()) weights.push_back({p.name, p.tensor.detach()});

  seed(out, "safetensors", "every-dtype", file_of(every_dtype(), {{"format", "pt"}}));
  seed(out, "safetensors", "micro-model-bf16", file_of(weights));
  seed(out, "safetensors", "nothing", file_of({}));

  seed(out, "safetensors_dir", "every-dtype", sharded(every_dtype(), 8));
  seed(out, "safetensors_dir", "micro-model", sharded(weights, 2048));

  for (const auto& [name, variant] : std::map<std::string, std::function<void(sbp::ModelConfig&)>>{
           {"qwen3", [](sbp::ModelConfig&) {}},
           {"qwen2", [](sbp::ModelConfig& c) { c.qk_norm = false, c.attention_bias = true; }},
           {"llama", [](sbp::ModelConfig& c) { c.qk_norm = false, c.tie_word_embeddings = true; }}}) {
    sbp::ModelConfig c = config;
    variant(c);
    seed(out, "checkpoint", "config-" + name, sbp::config_to_json(c, "bfloat16"));
  }
  seed(out, "checkpoint", "micro-model", join_parts({sbp::config_to_json(config, "bfloat16"), file_of(weights)}));

  sbp::Model adapted(config, at::kFloat, 1);
  adapted.add_lora(sbp::parse_lora_spec("rank=2,alpha=4,targets=q,v,down"), 2);
  const auto adapter_config = sbp::adapter_config_json(adapted.lora(), "micro");
  sbp::TensorList adapter_weights;
  for (const auto& a : adapted.adapters()) adapter_weights.push_back({a.name, a.tensor.detach()});
  seed(out, "adapter", "q-v-down", join_parts({adapter_config, file_of(adapter_weights, {{"format", "pt"}})}));
  auto all_linear = nlohmann::json::parse(adapter_config);
  all_linear["target_modules"] = "all-linear";
  seed(out, "adapter", "all-linear-config", all_linear.dump(2));

  int n = 0;
  for (const std::string spec :
       {sbp::make_method("standard")->spec(), sbp::make_method("checkpoint")->spec(), sbp::make_method("mst")->spec(),
        sbp::make_method("streambp")->spec(), sbp::make_objective("sft")->spec(), sbp::make_objective("grpo")->spec(),
        sbp::make_objective("dpo")->spec(), std::string("adamw:lr=1e-3,weight_decay=0.01"), std::string("sgd:lr=0.1"),
        std::string("cosine:warmup=10"), std::string("rank=4,alpha=8,targets=q,k,v,o"), std::string("bf16"),
        std::string("cuda:1")})
    seed(out, "spec", "spec-" + std::to_string(n++), spec);

  for (const char* spec : {"sft", "grpo", "dpo"}) {
    auto objective = sbp::make_objective(spec);
    const auto batch = sbp::prepared_random_batch(model, *objective, 2, 8, 0, 3);
    const auto file = sbp::fuzz::scratch() / "batch.safetensors";
    sbp::write_batch_file(batch, file);
    seed(out, "batch", spec, slurp(file));
  }

  sbp::ResultsTable table({"seq_len", "peak_bytes", "note"});
  table.add({"tiny", "streambp:layer_chunk=64", "fp32", "passed", 1, {"256", "1048576", "\"quoted, with comma\""}, {}});
  table.add({"tiny", "checkpoint", "bf16", "oom", 2, {"512", "", ""}, {}});
  sbp::Provenance p{"0123abc", "2026-01-01T00:00:00Z", "machine", 2, "2.14.1", "streambp sweep seq"};
  const auto csv = sbp::fuzz::scratch() / "sweep.csv";
  table.write_to(csv, p, nlohmann::json::array({{{"commit", "earlier"}}}));
  seed(out, "results_csv", "sweep", join_parts({slurp(csv), slurp(fs::path(csv).replace_extension(".json"))}));
  {  // a checkpoint of one AdamW step on the micro model (fp32, as fuzz_train_resume's trainer), and a metrics file
    sbp::Model trained(config, at::kFloat, 1);
    auto method = sbp::make_method("standard");
    auto objective = sbp::make_objective("sft");
    sbp::Trainer trainer(trained, *method, *objective, {});
    trainer.step(sbp::prepared_random_batch(trained, *objective, 2, 8, 0, 5));
    const auto checkpoint = trainer.save_checkpoint(sbp::fuzz::scratch() / "train", {{"seed", 5}});
    seed(out, "train_resume", "one-step",
         join_parts({slurp(checkpoint / "trainer.json"), slurp(checkpoint / "trainable.safetensors"),
                     slurp(checkpoint / "optimizer.safetensors"), "step,loss\n1,0.5\n2,0.25\n4,0.125\n"}));
  }
  std::cout << "fuzz seeds in " << out.string() << "\n";
  return 0;
}
