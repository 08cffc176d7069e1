#include "experiments/conform_diagnosis.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <set>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "baselines/methods.h"
#include "core/model/checkpoint_io.h"
#include "core/objectives/catalogue.h"
#include "experiments/setup.h"

namespace sbp {

namespace {

// Agreement this close with a changed oracle, while the true one is a hundred times further off, names the bug.
constexpr double kDiagnosisRtol = 1e-8;

// The worst normwise error of `got` against the fp64 standard BP of `batch` on the case's files (normalised by
// `totals` when given); infinity when they cannot be compared.
double error_against(const ConformCase& c, const std::filesystem::path& dir, const Batch& batch,
                     const std::optional<StepTotals>& totals, const TensorList& got) {
  auto model = load_model_dir(dir / "model", at::kDouble);
  if (!c.lora.empty()) apply_lora(*model, {}, (dir / "adapter").string(), c.batch.seed);
  const auto objective = make_objective(c.objective);
  make_method("standard")->step(*model, *objective, batch, {.step_totals = totals});
  TensorList grads;
  for (const auto& g : model->gradients()) grads.push_back({g.name, g.tensor.detach()});
  const auto verdict = judge_exact(grads, got, kDiagnosisRtol);
  return verdict.problem.empty() ? verdict.worst : std::numeric_limits<double>::infinity();
}

}  // namespace

std::string tile_boundary_hint(const ConformCase& c, const std::filesystem::path& dir, const Batch& batch,
                               const TensorList& got, double worst) {
  if (!batch.has("labels") || !c.micro_batches.empty() || c.ranks != 1) return "";
  const auto T = batch.seq_len();
  const auto totals = make_objective(c.objective)->prepare(batch, c.config).batch_totals();
  std::set<std::int64_t> tried;
  for (const auto& [tile, chunk] : {std::pair{"head", c.head_chunk}, std::pair{"layer", c.layer_chunk}}) {
    if (chunk >= T || !tried.insert(chunk).second) continue;
    auto labels = batch.field("labels").clone();  // [B, T]: position t - 1 predicts labels[:, t]
    for (std::int64_t t = chunk; t < T; t += chunk) labels.select(1, t).fill_(-100);
    if (labels.equal(batch.field("labels"))) continue;  // no target crosses a boundary: nothing to tell apart
    Batch dropped = batch;
    dropped.fields["labels"] = labels;
    for (const bool by_all : {false, true}) {
      const double error = error_against(c, dir, dropped, by_all ? std::optional(totals) : std::nullopt, got);
      if (error <= kDiagnosisRtol && error * 100 < worst)
        return fmt::format("the error sits next to the {} tile boundaries (every {} positions): the gradients are "
                           "the oracle's without the targets that cross a tile boundary{}, as when the labels are "
                           "shifted inside each tile after splitting instead of once before (docs/conformance.md)",
                           tile, chunk, by_all ? " (normalised by all the batch's targets)" : "");
    }
  }
  return "";
}

}  // namespace sbp
