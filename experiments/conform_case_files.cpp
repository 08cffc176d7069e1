#include "experiments/conform_case_files.h"

#include <cmath>
#include <fstream>
#include <iterator>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "baselines/methods.h"
#include "core/model/checkpoint_io.h"
#include "core/objectives/catalogue.h"
#include "experiments/batches.h"
#include "experiments/commands.h"
#include "experiments/conform_child.h"
#include "experiments/conform_diagnosis.h"
#include "experiments/results_table.h"
#include "verify/conform_packed.h"

namespace sbp {

namespace fs = std::filesystem;

Returned read_returned(const fs::path& dir, const ChildRun& run, c10::ScalarType dtype, std::size_t micro_batches,
                       bool with_loss) {
  Returned r;
  if (!run.outcome.empty()) {
    const auto tail = last_line(dir / "impl.log");
    r.problem = run.outcome + (tail.empty() ? "" : ": " + tail);
    return r;
  }
  const auto grads = dir / "grads.safetensors", result = dir / "result.json";
  if (!fs::exists(grads)) {
    r.problem = "wrote no grads.safetensors";
    return r;
  }
  try {
    r.grads = read_safetensors(grads);
  } catch (const std::exception& e) {
    r.problem = std::string("grads.safetensors: ") + e.what();
    return r;
  }
  if (auto problem = dtype_problem(r.grads, dtype); !problem.empty()) {
    r.problem = "grads.safetensors: " + problem;
    return r;
  }
  if (!fs::exists(result)) {
    r.problem = "wrote no result.json";
    return r;
  }
  if (!with_loss) return r;
  try {
    std::ifstream in(result);
    const std::string text(std::istreambuf_iterator<char>(in), {});
    r.loss = result_loss(text);
    if (std::isnan(*r.loss)) r.problem = "result.json: the loss is NaN";
    else if (std::isinf(*r.loss)) r.problem = fmt::format("result.json: the loss is {}Infinity", *r.loss < 0 ? "-" : "");
    else if (micro_batches > 0) r.problem = result_micro_batches_problem(text, micro_batches);
  } catch (const std::exception& e) {
    r.problem = std::string("result.json: ") + e.what();
  }
  return r;
}

void write_case(const ConformCase& c, const fs::path& dir, const Model& model, const Objective& objective,
                const Batch& batch) {
  fs::create_directories(dir);
  save_model_dir(model, dir / "model");
  if (!c.lora.empty()) save_adapter_dir(model, dir / "adapter", "model");
  write_batch_file(batch, dir / "batch.safetensors");
  write_file_atomically(dir / "case.json", case_json(c, objective).dump(2) + "\n");
}

std::pair<TensorList, double> oracle(const ConformCase& c, const fs::path& dir, const Batch& batch,
                                     Accumulation accumulation) {
  auto model = load_model_dir(dir / "model", at::kDouble);
  if (!c.lora.empty()) apply_lora(*model, {}, (dir / "adapter").string(), c.batch.seed);
  auto objective = make_objective(c.objective);
  auto standard = make_method("standard");
  const auto parts = accumulation == Accumulation::micro_means ? micro_batch_split(c, batch) : std::vector{batch};
  double loss = 0;
  for (std::size_t k = 0; k < parts.size(); ++k)
    loss += standard->step(*model, *objective, parts[k], {.accumulate = k > 0}).loss / double(parts.size());
  TensorList grads;
  for (const auto& g : model->gradients()) grads.push_back({g.name, g.tensor.detach().clone() / double(parts.size())});
  return {grads, loss};
}

void copy_case(const fs::path& from, const fs::path& to) {
  fs::create_directories(to);
  for (const auto* name : {"model", "adapter", "batch.safetensors", "case.json"})
    if (fs::exists(from / name)) fs::copy(from / name, to / name, fs::copy_options::recursive);
}

}  // namespace sbp
