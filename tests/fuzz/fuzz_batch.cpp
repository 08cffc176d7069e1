// libFuzzer target: a batch file (--batch FILE) as `streambp run` takes it: read_batch_file, validate_tokens, the
// reference pass that fills what the file lacks, and each objective's prepare() -- SFT, GRPO with a KL term, DPO --
// against a micro model (fuzz_support.h). Refusals must name the file. A batch that every check accepted must then
// run: one step of standard BP on it may not throw (a check that lets through what the model cannot take, e.g. a
// token outside the vocabulary, shows up here as torch's error, not ours).
#include <ATen/ATen.h>

#include "baselines/methods.h"
#include "core/model/model.h"
#include "core/objectives/objective.h"
#include "experiments/batches.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace sbp::fuzz;
  clear_scratch();
  const auto file = put("batch.safetensors", {reinterpret_cast<const char*>(data), size});
  const std::string source = file.string();
  static sbp::Model model(micro_config(), at::kDouble, 0);  // never changed: BP only writes its gradients
  for (const char* spec : {"sft", "grpo:beta=0.04", "dpo"}) {
    auto objective = sbp::make_objective(spec);
    sbp::Batch batch;
    const bool ok = refuses_cleanly(std::string("reading a batch for ") + spec, source, [&] {
      batch = sbp::read_batch_file(file);
      sbp::validate_tokens(batch, model.config(), source);
      sbp::complete_batch(model, *objective, batch, source, false, "", at::kDouble, 0);
      objective->prepare(batch, model.config(), std::nullopt, source);
    });
    if (!ok) continue;
    try {
      sbp::make_method("standard")->step(model, *objective, batch);
    } catch (const std::exception& e) {
      finding(std::string("a batch the checks accepted for ") + spec + " fails in the step: " + e.what());
    }
  }
  return 0;
}
