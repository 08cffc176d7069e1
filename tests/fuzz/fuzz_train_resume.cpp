// libFuzzer target: what `train --resume DIR` reads -- a checkpoint folder (trainer.json, trainable.safetensors,
// optimizer.safetensors: the input's first three parts) through Trainer::load_checkpoint on a micro model with
// AdamW, and the earlier metrics file (fourth part) through read_metrics_rows. Refusals must name a file of the
// folder or the folder, and the metrics file.
#include <ATen/ATen.h>

#include "baselines/methods.h"
#include "core/model/model.h"
#include "core/objectives/objective.h"
#include "core/training/trainer.h"
#include "experiments/results_table.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace sbp::fuzz;
  const auto parts = split_parts(data, size);
  const auto dir =
      put_folder("checkpoint-00000001", parts, {"trainer.json", "trainable.safetensors", "optimizer.safetensors"});
  const auto metrics = put("metrics.csv", parts.size() > 3 ? parts[3] : std::string_view());

  sbp::Model model(micro_config(), at::kFloat, 0);
  auto method = sbp::make_method("standard");
  auto objective = sbp::make_objective("sft");
  sbp::Trainer trainer(model, *method, *objective, {});
  refuses_cleanly("Trainer::load_checkpoint", dir.string(), [&] { (void)trainer.load_checkpoint(dir); });
  refuses_cleanly("read_metrics_rows", metrics.string(), [&] { (void)sbp::read_metrics_rows(metrics, "step,loss", 3); });
  return 0;
}
