// Running out of memory (issue #44): a step whose modelled peak cannot fit is refused before it starts, with the
// longest sequence that would fit; a block the system refuses is an `oom` naming its size, never a generic error; the
// budget is reported as given; a long step says where it is; a column of byte counts has one unit.
#include <catch2/catch.hpp>

#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "baselines/methods.h"
#include "core/methods/streambp.h"
#include "core/model/model.h"
#include "core/objectives/sft.h"
#include "experiments/available_memory.h"
#include "experiments/batches.h"
#include "experiments/measure.h"
#include "experiments/memory_check.h"
#include "experiments/step_progress.h"
#include "profiler/cpu_meter.h"
#include "tests/support/test_support.h"

namespace {

using sbp::CpuMemoryMeter;

// More than x86-64's 128 TiB of user address space: no machine grants it, whatever its limits and overcommit.
constexpr std::int64_t kImpossibleBytes = std::int64_t(1) << 50;

// StreamBP that asks for an impossible block as its first layer's backward starts: the system's refusal in the
// middle of a step.
class ImpossibleBlockStreamBP : public sbp::StreamBP {
 public:
  using StreamBP::StreamBP;

 protected:
  void stream_layer_backward(const sbp::Model& model, int layer, const at::Tensor& h_in, at::Tensor& g,
                             sbp::PhaseClock& clock) const override {
    const auto block = at::empty({kImpossibleBytes}, at::kByte);
    StreamBP::stream_layer_backward(model, layer, h_in, g, clock);
  }
};

struct TinyStep {
  sbp::Model model{sbp::test::tiny_config(), at::kFloat, 91};
  sbp::SftObjective objective;
  sbp::Batch batch;
  explicit TinyStep(std::int64_t T) : batch(sbp::random_sft_batch(model.config(), {1, T, 0.0, 0.0, 92})) {}
  sbp::Workload workload() const { return sbp::make_workload(model, objective.prepare(batch, model.config()), batch); }
};

std::string read_text(std::FILE* file) {
  std::rewind(file);
  std::string text;
  for (int c; (c = std::fgetc(file)) != EOF;) text += char(c);
  return text;
}

}  // namespace

TEST_CASE("a step whose modelled peak is above what it may use is refused with the longest T that fits",
          "[memory-check]") {
  TinyStep step(64);
  const auto method = sbp::make_method("checkpoint");
  const auto workload = step.workload();
  const auto peak_at = [&](std::int64_t T) {
    auto w = workload;
    w.seq_len = T;
    return method->memory_model(w).total_bytes();
  };
  const std::int64_t held = sbp::model_weight_bytes(step.model);
  // A limit on further memory that leaves room for the model's peak at T = 40 and not at 41: the weights the step
  // already holds are part of its peak, so they are added to what is left.
  const sbp::MemoryLimit limit{"ulimit -v", peak_at(40) - held, "injected"};
  const auto check = sbp::check_memory(peak_at, 64, "a moment", 0, {limit}, held);
  CHECK_FALSE(check.fits());
  CHECK(check.peak_bytes == peak_at(64));
  CHECK(check.limit_bytes == peak_at(40));
  CHECK(check.max_seq == 40);  // the models grow with T: 40 fits, 41 does not
  CHECK_THAT(check.limited_by, Catch::Contains("ulimit -v"));
  CHECK_THAT(sbp::memory_shortfall(check, 1), Catch::Contains("the longest sequence that fits is T = 40"));

  SECTION("the budget, when tighter, is the limit, as given") {
    const auto budgeted = sbp::check_memory(peak_at, 64, "a moment", peak_at(20), {limit}, held);
    CHECK(budgeted.limit_bytes == peak_at(20));
    CHECK(budgeted.max_seq == 20);
    CHECK(budgeted.limited_by == "--budget-bytes " + std::to_string(peak_at(20)));
  }
  SECTION("a limit with room for the peak lets the step run") {
    const sbp::MemoryLimit roomy{"MemAvailable", peak_at(64) - held, "injected"};
    const auto fits = sbp::check_memory(peak_at, 64, "a moment", 0, {roomy}, held);
    CHECK(fits.fits());
    CHECK(fits.max_seq == -1);
  }
  SECTION("below the shortest sequence nothing fits") {
    const auto none = sbp::check_memory(peak_at, 64, "a moment", peak_at(2) - 1, {}, held);
    CHECK(none.max_seq == 0);
    CHECK_THAT(sbp::memory_shortfall(none, 1), Catch::Contains("no sequence fits"));
  }
  SECTION("no limit known: nothing to check") {
    CHECK(sbp::check_memory(peak_at, 64, "a moment", 0, {}, held).fits());
  }
}

TEST_CASE("the longest fitting T is the last T of a linear scan", "[memory-check]") {
  const auto peak_at = [](std::int64_t T) { return 1000 + 7 * T + (T > 50 ? 100 : 0); };  // grows, with a step
  for (const std::int64_t limit : {999, 1014, 1015, 1349, 1450, 1457, 1800, 5000}) {
    std::int64_t scan = 0;
    for (std::int64_t T = 2; T <= 100; ++T)
      if (peak_at(T) <= limit) scan = T;
    INFO("limit " << limit);
    CHECK(sbp::longest_fitting_seq(peak_at, 2, 100, limit) == scan);
  }
}

TEST_CASE("ulimit -v is read as what is left of the address space", "[memory-check][system-memory]") {
  rlimit before{};
  REQUIRE(getrlimit(RLIMIT_AS, &before) == 0);
  const auto mapped = [] {
    std::ifstream in("/proc/self/status");
    for (std::string key; in >> key;)
      if (key == "VmSize:") {
        std::int64_t kib = 0;
        in >> kib;
        return kib * 1024;
      }
    return std::int64_t(-1);
  }();
  REQUIRE(mapped > 0);
  const std::int64_t room = std::int64_t(4) << 30;
  rlimit lowered = before;
  lowered.rlim_cur = rlim_t(mapped + room);
  REQUIRE(setrlimit(RLIMIT_AS, &lowered) == 0);
  const auto limits = sbp::memory_limits();
  REQUIRE(setrlimit(RLIMIT_AS, &before) == 0);
  const sbp::MemoryLimit* address_space = nullptr;
  for (const auto& l : limits)
    if (l.name == "ulimit -v") address_space = &l;
  REQUIRE(address_space != nullptr);
  // Between the two reads of VmSize the process may map a little (the reading itself): within 64 MiB.
  CHECK(address_space->left_bytes <= room);
  CHECK(address_space->left_bytes >= room - (std::int64_t(64) << 20));
}

TEST_CASE("a block the system refuses is an out-of-memory naming its size, and nothing stays counted",
          "[memory-check][system-memory][meter]") {
  auto& meter = CpuMemoryMeter::install();
  const auto before = meter.current_bytes();
  try {
    const auto block = at::empty({kImpossibleBytes}, at::kByte);
    FAIL("an impossible block was granted");
  } catch (const c10::OutOfMemoryError& e) {
    CHECK_THAT(std::string(e.what_without_backtrace()),
               Catch::Contains("refused an allocation of " + std::to_string(kImpossibleBytes) + " bytes"));
  }
  CHECK(meter.current_bytes() == before);
}

TEST_CASE("a step whose block the system refuses ends as oom, naming the block", "[memory-check][system-memory]") {
  TinyStep step(32);
  ImpossibleBlockStreamBP method(sbp::StreamBP::Options{8, 8});
  const auto m = sbp::measure_method(step.model, method, step.objective, step.batch, 0, 1, 0);
  CHECK(m.status == sbp::StepStatus::oom);
  CHECK_THAT(m.error, Catch::Contains(std::to_string(kImpossibleBytes) + " bytes"));
  CHECK(m.bp_seconds.empty());
}

TEST_CASE("an over-budget step names the budget as given", "[memory-check][meter]") {
  TinyStep step(64);
  const auto method = sbp::make_method("standard");
  // Bytes held before the step that are not the model's: the meter leaves them outside the budget.
  const auto unrelated = at::empty({1 << 20}, at::kByte);
  const std::int64_t budget = 100'000;
  const auto m = sbp::measure_method(step.model, *method, step.objective, step.batch, 0, 1, budget);
  REQUIRE(m.status == sbp::StepStatus::oom);
  CHECK_THAT(m.error, Catch::Contains("budget of 100000 bytes"));
  CHECK_THAT(m.error, Catch::Contains("held before the step"));
}

TEST_CASE("a long step reports its phase and layer, and the meter still sees every phase", "[memory-check]") {
  TinyStep step(32);
  const auto method = sbp::make_method("checkpoint");
  auto& meter = CpuMemoryMeter::install();
  std::FILE* out = std::tmpfile();
  REQUIRE(out != nullptr);
  meter.reset_peak();
  {
    // No delay: every layer and outermost phase of this short step is "long".
    const sbp::StepProgress progress("step 1 of 1", int(step.model.config().num_hidden_layers), out, 0.0);
    method->step(step.model, step.objective, step.batch);
  }
  CHECK(sbp::phase_listener() == &meter);  // the meter is the listener again
  CHECK(meter.phase_peaks().size() >= 3);   // forward, head, layer, embedding: passed on to the meter
  const auto text = read_text(out);
  std::fclose(out);
  INFO(text);
  const auto L = step.model.config().num_hidden_layers;
  CHECK_THAT(text, Catch::Contains("progress  step 1 of 1, "));
  CHECK_THAT(text, Catch::Contains(": forward, layer 0 of 0-" + std::to_string(L - 1) + "\n"));
  CHECK_THAT(text, Catch::Contains(": backward, layer " + std::to_string(L - 1) + " of 0-" + std::to_string(L - 1) +
                                   " (layer)\n"));
  CHECK_THAT(text, Catch::Contains(": head\n"));
  // One line per layer and direction, one per outermost phase outside the layers (the backward's "layer" phase, a
  // phase of every layer, once): forward, L layers, head, layer, L layers, embedding.
  CHECK(std::count(text.begin(), text.end(), '\n') == 2 * L + 4);
}

TEST_CASE("a short step prints no progress", "[memory-check]") {
  TinyStep step(16);
  const auto method = sbp::make_method("standard");
  std::FILE* out = std::tmpfile();
  REQUIRE(out != nullptr);
  {
    const sbp::StepProgress progress("step 1 of 1", int(step.model.config().num_hidden_layers), out, 3600.0);
    method->step(step.model, step.objective, step.batch);
  }
  CHECK(read_text(out).empty());
  std::fclose(out);
}

TEST_CASE("a column of byte counts has one unit", "[memory-check]") {
  const std::int64_t mib = 1 << 20;
  const auto unit = sbp::byte_unit_for(std::int64_t(1.26 * 1024) * mib);
  CHECK(sbp::format_bytes(std::int64_t(1003.3 * mib), unit) == "0.98 GiB");
  CHECK(sbp::format_bytes(std::int64_t(1.26 * 1024) * mib, unit) == "1.26 GiB");
  CHECK(sbp::format_bytes(std::int64_t(1003.3 * mib)) == "1003.3 MiB");  // alone, its own unit
}
