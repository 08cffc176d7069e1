// Test helper of tests/oracle/optimizer_oracle.py (not a user command): runs our optimizer, gradient clipping and lr schedule
// over the parameters and per-step gradients of a safetensors file, and writes what they produce, so that the
// script can compare them with torch.optim + clip_grad_norm_ + transformers' schedules bit for bit.
//
//   optimizer_probe IN.safetensors OUT.safetensors
// IN: tensors "param/<name>" (initial values) and "grad/<k>/<name>" (gradient of step k; absent = no gradient that
// step); metadata "param_names" (comma-separated, the order torch sees), "optimizer" (spec), "state_dtype" ("param"
// or fp64/fp32/bf16), "schedule" (spec), "steps", "total_steps", "max_norm" ("none" or a number), "threads",
// "resume_at" (optional: after that many steps, save the state to a file, build a fresh optimizer, load it, go on).
// OUT: "param/<name>" after the last step, "state/<state name>" (Optimizer::state()), "lr/<k>" and "norm/<k>" (0-dim
// fp64: the lr of step k and the gradient norm clip_grad_norm returned). Exit code 0, or 2 with a message.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>

#include "core/training/lr_schedule.h"
#include "core/training/optimizer.h"
#include "core/io/safetensors.h"

namespace {

std::string required(const std::map<std::string, std::string>& metadata, const std::string& key) {
  const auto it = metadata.find(key);
  if (it == metadata.end()) throw std::invalid_argument("metadata '" + key + "' missing");
  return it->second;
}

int run(const std::filesystem::path& in, const std::filesystem::path& out) {
  const auto metadata = sbp::read_safetensors_metadata(in);
  std::map<std::string, at::Tensor> tensors;
  for (auto& [name, tensor] : sbp::read_safetensors(in)) tensors[name] = tensor;
  at::set_num_threads(std::stoi(required(metadata, "threads")));

  sbp::OptimizerOptions options = sbp::parse_optimizer_spec(required(metadata, "optimizer"));
  const auto state_dtype = required(metadata, "state_dtype");
  if (state_dtype != "param") options.state_dtype = sbp::parse_state_dtype(state_dtype);
  const auto schedule = sbp::parse_lr_schedule(required(metadata, "schedule"));
  const auto steps = std::stoll(required(metadata, "steps"));
  const auto total_steps = std::stoll(required(metadata, "total_steps"));
  const auto max_norm_text = required(metadata, "max_norm");
  const std::optional<double> max_norm =
      max_norm_text == "none" ? std::nullopt : std::optional<double>(std::stod(max_norm_text));
  const auto resume_it = metadata.find("resume_at");
  const std::int64_t resume_at = resume_it == metadata.end() ? -1 : std::stoll(resume_it->second);

  sbp::TensorList params;
  std::vector<at::Tensor> leaves;
  std::stringstream names(required(metadata, "param_names"));
  for (std::string name; std::getline(names, name, ',');) {
    const at::Tensor p = tensors.at("param/" + name).clone().requires_grad_(true);
    params.push_back({name, p});
    leaves.push_back(p);
  }
  auto optimizer = std::make_unique<sbp::Optimizer>(params, options);
  sbp::TensorList results;
  for (std::int64_t k = 0; k < steps; ++k) {
    if (k == resume_at) {
      const auto file = std::filesystem::path(out).replace_extension(".resume.safetensors");
      sbp::save_optimizer_state(*optimizer, file);
      optimizer = std::make_unique<sbp::Optimizer>(params, options);
      sbp::load_optimizer_state(*optimizer, file);
      std::filesystem::remove(file);
    }
    for (auto& [name, p] : params) {
      const auto it = tensors.find("grad/" + std::to_string(k) + "/" + name);
      p.mutable_grad() = it == tensors.end() ? at::Tensor() : it->second.clone();
    }
    const double norm = max_norm ? sbp::clip_grad_norm(leaves, *max_norm) : 0.0;
    const double lr = sbp::lr_at(schedule, options.lr, k, total_steps);
    optimizer->step(lr);
    results.push_back({"lr/" + std::to_string(k), at::scalar_tensor(lr, at::kDouble)});
    results.push_back({"norm/" + std::to_string(k), at::scalar_tensor(norm, at::kDouble)});
  }
  for (const auto& [name, p] : params) results.push_back({"param/" + name, p.detach()});
  for (const auto& [name, s] : optimizer->state()) results.push_back({"state/" + name, s});
  sbp::write_safetensors(out, results, {{"format", "pt"}});
  return 0;
}

}  // namespace

int main(int argc, char* argv[]) {
  if (argc != 3) {
    std::cerr << "usage: optimizer_probe IN.safetensors OUT.safetensors (a helper of tests/oracle/optimizer_oracle.py)\n";
    return 2;
  }
  try {
    return run(argv[1], argv[2]);
  } catch (const std::exception& e) {
    std::cerr << "optimizer_probe: " << e.what() << "\n";
    return 2;
  }
}
