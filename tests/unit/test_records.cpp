// The records the commands write: run's and train's JSON take their memory fields from one writer (one name and one
// rule per field, null where there is nothing to say), and train's metrics header and rows come from one table.
// Their words come from enums parsed once from the flags (status, check, offload kind, dtype).
#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <string>

#include <CLI/CLI.hpp>

#include "core/offload/offload_tier.h"
#include "experiments/measure.h"
#include "experiments/memory_record.h"
#include "experiments/options.h"
#include "experiments/results_table.h"
#include "experiments/setup.h"
#include "experiments/train_metrics.h"

namespace {

sbp::MemoryEstimate two_terms() {
  sbp::MemoryEstimate e;
  e.moment = "head backward";
  e.terms = {{"weights", 1000}, {"logits", 24}};
  e.host = {{"checkpoints", 512}};
  return e;
}

int commas(const std::string& line) { return int(std::count(line.begin(), line.end(), ',')); }

}  // namespace

TEST_CASE("the memory fields of run's and train's records: one writer, null where nothing was modelled or offloaded",
          "[records]") {
  const std::vector<std::string> fields = {"host_peak_bytes", "model_host_bytes", "model_peak_bytes",
                                           "model_peak_moment", "model_terms", "offload"};
  SECTION("no estimate (a run that took no step), no tier: every value null but the offload kinds") {
    const auto j = sbp::memory_record(nullptr, "none", nullptr);
    std::vector<std::string> keys;
    for (const auto& [key, value] : j.items()) keys.push_back(key);
    CHECK(keys == fields);
    for (const auto& key : fields)
      if (key != "offload") CHECK(j.at(key).is_null());
    CHECK(j.at("offload") == "none");
  }
  SECTION("an estimate without a tier: the model's peak, moment and terms; nothing on the host") {
    const auto e = two_terms();
    const auto j = sbp::memory_record(&e, "none", nullptr);
    CHECK(j.at("model_peak_bytes") == 1024);
    CHECK(j.at("model_peak_moment") == "head backward");
    CHECK(j.at("model_terms") == nlohmann::json::array({{{"name", "weights"}, {"bytes", 1000}},
                                                        {{"name", "logits"}, {"bytes", 24}}}));
    CHECK(j.at("host_peak_bytes").is_null());
    CHECK(j.at("model_host_bytes").is_null());
  }
  SECTION("an estimate and a tier: the tier's measured peak beside the model's host bytes") {
    const auto dir = std::filesystem::temp_directory_path() / "streambp-test-records";
    std::filesystem::create_directories(dir);
    {
      const auto tier = sbp::make_offload_tier(c10::Device(c10::kCPU), dir.string());
      const auto e = two_terms();
      const auto j = sbp::memory_record(&e, "checkpoints", tier.get());
      CHECK(j.at("host_peak_bytes") == tier->peak_bytes());
      CHECK(j.at("model_host_bytes") == 512);
      CHECK(j.at("offload") == "checkpoints");
      // A tier but no estimate: the measured peak stays, the modelled one is null.
      CHECK(sbp::memory_record(nullptr, "checkpoints", tier.get()).at("model_host_bytes").is_null());
    }
    std::filesystem::remove_all(dir);
  }
}

TEST_CASE("train's metrics rows have the header's columns, a CUDA row's peak left empty", "[records]") {
  sbp::StepMetrics m;
  m.step.step = 3;
  m.peak_bytes = 4096;
  const auto header = sbp::metrics_header();
  CHECK(header.rfind("step,loss,grad_norm,lr,tokens,", 0) == 0);
  CHECK(commas(sbp::metrics_row(m)) == commas(header));
  CHECK(sbp::metrics_row(m).rfind("3,", 0) == 0);
  m.peak_bytes.reset();
  CHECK(sbp::metrics_row(m).find(",,") != std::string::npos);
}

TEST_CASE("flags arrive as enums, parsed once, and name themselves back in the records' words", "[records][options]") {
  CLI::App app;
  sbp::OffloadOptions offload;
  sbp::add_offload_options(app, offload, "moved");
  sbp::Setup setup;
  sbp::add_setup_options(app, setup);
  app.parse("--offload grads,checkpoints --dtype bf16 --grad-dtype fp32", false);
  CHECK((offload.kinds == std::vector{sbp::OffloadKind::gradients, sbp::OffloadKind::checkpoints}));
  CHECK((offload.gradients() && offload.checkpoints() && !offload.optimizer() && !offload.parameters()));
  CHECK(offload.describe() == "grads,checkpoints");  // the results' offload column: the kinds in the order given
  CHECK(setup.model_dtype() == c10::kBFloat16);
  CHECK(setup.grad_dtype == c10::kFloat);
  // A name that is no kind (or no dtype) is a usage error naming the flag, before any work.
  for (const char* bad : {"--offload grads,weights", "--dtype fp16"}) {
    CLI::App again;
    sbp::OffloadOptions o;
    sbp::Setup s;
    sbp::add_offload_options(again, o, "moved");
    sbp::add_setup_options(again, s);
    CHECK_THROWS_AS(again.parse(bad, false), CLI::ValidationError);
  }
  CHECK(sbp::Setup{}.model_dtype() == c10::kFloat);  // no --dtype and no --load: fp32
  // --lora and --device arrive typed (parsed after CLI11's own checks); the spec as given stays for the fingerprint.
  sbp::Setup typed;
  CLI::App typed_app;
  sbp::add_setup_options(typed_app, typed);
  typed_app.parse("--lora rank=4,targets=q,v --device cpu", false);
  CHECK(typed.lora.spec() == "rank=4,alpha=8,targets=q,v,init=peft");
  CHECK(typed.lora_spec == "rank=4,targets=q,v");
  CHECK(typed.device == c10::Device(c10::kCPU));
  CHECK(!sbp::Setup{}.lora.enabled());
  for (const char* bad : {"--lora rank=0", "--device tpu"}) {
    CLI::App again;
    sbp::Setup s;
    sbp::add_setup_options(again, s);
    CHECK_THROWS_AS(again.parse(bad, false), sbp::InputError);
  }
  // The words the CSVs and JSON records have always had.
  CHECK(std::string(sbp::step_status_name(sbp::StepStatus::oom)) == "oom");
  CHECK(std::string(sbp::check_status_name(sbp::CheckStatus::reference)) == "reference");
  CHECK(std::string(sbp::check_status_name(sbp::CheckStatus::unchecked)) == "unchecked");
  CHECK(std::string(sbp::check_status_name(sbp::CheckStatus::passed)) == "passed");
  CHECK(std::string(sbp::check_status_name(sbp::CheckStatus::incorrect)) == "incorrect");
  CHECK(std::string(sbp::offload_kind_name(sbp::OffloadKind::parameters)) == "params");
  CHECK(std::string(sbp::offload_kind_name(sbp::OffloadKind::optimizer)) == "optimizer");
  // One name for one thing: train's metrics call the layout's columns what maxlen's and project's CSVs call them.
  CHECK(sbp::metrics_header().find(",world_size,zero,") != std::string::npos);
  CHECK(sbp::metrics_header().find(",sequence_parallel,sp_all_gather_calls,") != std::string::npos);
}
