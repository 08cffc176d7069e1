#include "tests/support/test_support.h"

#include <cmath>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "baselines/methods.h"
#include "core/objectives/sft.h"
#include "core/methods/streaming.h"
#include "core/methods/workload.h"
#include "verify/grad_compare.h"

namespace sbp::test {

TempDir::TempDir(const std::string& prefix) {
  std::random_device device;
  path_ = std::filesystem::temp_directory_path() /
          (prefix + std::to_string(device()) + "_" + std::to_string(device()));
  std::filesystem::create_directories(path_);
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

std::string read_bytes(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

void write_bytes(const std::filesystem::path& file, const std::string& bytes) {
  std::ofstream out(file, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

StepGradients run_step(Model& model, const std::string& spec, const Batch& batch) {
  SftObjective objective;
  return run_step(model, spec, objective, batch);
}

Batch objective_batch(const Model& model, const Objective& objective, const RandomBatchOptions& options) {
  Batch batch = objective.random_batch(model.config(), options);
  if (objective.wants_policy_logps())
    objective.add_synthetic_logps(batch, sequence_logps(model, batch, objective.temperature()), options.seed,
                                  /*reference_given=*/false);
  return batch;
}

StepGradients run_step(Model& model, const std::string& spec, Objective& objective, const Batch& batch) {
  auto method = make_method(spec);
  StepGradients out;
  out.loss = method->step(model, objective, batch).loss;
  for (const auto& g : model.gradients()) out.gradients.push_back({g.name, g.tensor.clone()});
  return out;
}

ModelConfig tiny_config() { return preset_config("tiny"); }

ModelConfig untied_mha_with_biases() {
  auto c = tiny_config();
  c.tie_word_embeddings = false;
  c.num_key_value_heads = c.num_attention_heads;
  c.qk_norm = false;
  c.attention_bias = true;
  c.o_proj_bias = true;
  return c;
}

std::string describe(const ModelConfig& c) {
  std::ostringstream s;
  s << "d=" << c.hidden_size << ",L=" << c.num_hidden_layers << ",heads=" << c.num_attention_heads << "x"
    << c.head_dim << ",kv=" << c.num_key_value_heads << ",V=" << c.vocab_size << ",I=" << c.intermediate_size
    << ",tied=" << c.tie_word_embeddings << ",qk_norm=" << c.qk_norm << ",bias=" << c.attention_bias
    << ",o_bias=" << c.o_proj_bias;
  return s.str();
}

const PhasePeak* find_phase(const std::vector<PhasePeak>& peaks, const std::string& name) {
  for (const auto& p : peaks)
    if (p.name == name) return &p;
  return nullptr;
}

double trajectory_difference(const std::vector<double>& losses_a, const TensorList& params_a,
                             const std::vector<double>& losses_b, const TensorList& params_b) {
  if (losses_a.size() != losses_b.size()) throw std::runtime_error("trajectory_difference: step counts differ");
  double worst = 0;
  for (std::size_t s = 0; s < losses_a.size(); ++s)
    worst = std::max(worst, std::abs(losses_a[s] - losses_b[s]) / std::abs(losses_a[s]));
  const auto cmp = compare_gradients(params_a, params_b);
  if (!cmp.problems.empty()) throw std::runtime_error("trajectory_difference: " + cmp.problems.front());
  return std::max(worst, cmp.max_normwise_rel());
}

bool matches_model(std::int64_t measured, const MemoryEstimate& estimate) {
  const double model = double(estimate.total_bytes());
  // No peak is 0 bytes: a 0 on either side is a broken meter or model, and 0 / 0 matched its own lower bound 0.
  if (measured <= 0 || model <= 0) return false;
  if (std::abs(double(measured) / model - 1.0) <= 0.03) return true;
  std::int64_t scratch = 0;
  for (const auto& t : estimate.terms)
    if (t.name == "attention kernel scratch") scratch = t.bytes;
  const auto threads = std::max<std::int64_t>(1, at::get_num_threads());
  const double lowest = model - double(scratch) * double(threads - 1) / double(threads);
  return double(measured) <= 1.03 * model && double(measured) >= 0.97 * lowest;
}

}  // namespace sbp::test
