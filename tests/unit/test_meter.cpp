// (Over 500 lines: every case that holds a method's memory model against the meter shares step_memory and
// test_support's matches_model, the tolerance rule with its measured exception; the per-rank models live in test_zero_memory.cpp.)
// The CPU memory meter (ARCHITECTURE.md §7) and what it proves about the methods: exact byte counts, phase attribution, the
// budget, agreement with the kernel's RSS, StreamBP's O(T) memory, and the analytic memory models.
#include <catch2/catch.hpp>

#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "baselines/methods.h"
#include "core/model/model.h"
#include "core/objectives/sft.h"
#include "core/model/lora.h"
#include "core/offload/offload_tier.h"
#include "core/methods/phase.h"
#include "experiments/batches.h"
#include "experiments/measure.h"
#include "profiler/cpu_meter.h"
#include "profiler/memory_categories.h"
#include "tests/support/test_support.h"

using sbp::CpuMemoryMeter;

namespace {

constexpr std::int64_t kMillionDoubles = 8'000'000;  // bytes of at::empty({1000, 1000}, kDouble)

at::Tensor million_doubles() { return at::empty({1000, 1000}, at::kDouble); }

// Sets a budget for one scope and always lifts it, so that a failing check cannot leave later tests under it.
class BudgetScope {
 public:
  explicit BudgetScope(std::int64_t bytes) { CpuMemoryMeter::install().set_budget_bytes(bytes); }
  ~BudgetScope() { CpuMemoryMeter::install().set_budget_bytes(0); }
  BudgetScope(const BudgetScope&) = delete;
  BudgetScope& operator=(const BudgetScope&) = delete;
};

}  // namespace

TEST_CASE("the meter counts a known allocation exactly and frees it", "[meter]") {
  auto& meter = CpuMemoryMeter::install();
  const auto before = meter.current_bytes();
  meter.reset_peak();
  CHECK(meter.peak_bytes() == before);
  CHECK(meter.largest_allocation_bytes() == 0);
  {
    const auto block = million_doubles();
    CHECK(meter.current_bytes() - before == kMillionDoubles);
    CHECK(meter.peak_bytes() - before == kMillionDoubles);
    CHECK(meter.largest_allocation_bytes() == kMillionDoubles);
  }
  CHECK(meter.current_bytes() == before);
  CHECK(meter.peak_bytes() - before == kMillionDoubles);  // the peak remembers the freed block
  {
    const auto a = million_doubles(), b = million_doubles();
    CHECK(meter.peak_bytes() - before == 2 * kMillionDoubles);
    CHECK(meter.largest_allocation_bytes() == kMillionDoubles);  // two blocks, not one of twice the size
  }
  CHECK(meter.current_bytes() == before);
}

TEST_CASE("phase peaks attribute an allocation to the phases open while it lives", "[meter][phase]") {
  auto& meter = CpuMemoryMeter::install();
  sbp::PhaseClock clock;
  meter.reset_peak();
  const auto base = meter.current_bytes();
  {
    sbp::Phase outer(clock, "outer");
    { const auto big = million_doubles(); }
    sbp::Phase inner(clock, "inner");  // opens after the big block is gone: must not see it
    const auto small = at::empty({1000}, at::kDouble);
  }
  { sbp::Phase after(clock, "after"); }
  { sbp::Phase again(clock, "inner"); }
  const auto peaks = meter.phase_peaks();
  const auto* outer = sbp::test::find_phase(peaks, "outer");
  const auto* inner = sbp::test::find_phase(peaks, "inner");
  const auto* after = sbp::test::find_phase(peaks, "after");
  REQUIRE(outer != nullptr);
  REQUIRE(inner != nullptr);
  REQUIRE(after != nullptr);
  CHECK(outer->peak_bytes - base == kMillionDoubles);
  CHECK(outer->count == 1);
  CHECK(inner->peak_bytes - base == 8'000);
  CHECK(inner->count == 2);
  CHECK(after->peak_bytes == base);
  CHECK(clock.totals().size() == 3);
}

TEST_CASE("the budget throws c10::OutOfMemoryError and leaves nothing counted", "[meter][budget]") {
  auto& meter = CpuMemoryMeter::install();
  const auto base = meter.current_bytes();
  {
    BudgetScope budget(base + kMillionDoubles / 2);
    CHECK(meter.budget_bytes() == base + kMillionDoubles / 2);
    CHECK_THROWS_AS(million_doubles(), c10::OutOfMemoryError);
    CHECK(meter.current_bytes() == base);
    const auto fits = at::empty({1000}, at::kDouble);  // the meter still works under the budget
    CHECK(meter.current_bytes() - base == 8'000);
  }
  CHECK(meter.budget_bytes() == 0);
  CHECK(meter.current_bytes() == base);
  const auto after = million_doubles();  // no budget: allowed again
  CHECK(meter.current_bytes() - base == kMillionDoubles);
}

TEST_CASE("threads allocating at the budget's edge never take the count past it", "[meter][budget]") {
  // Eight threads race for room for three blocks, many times over: the check and the count are one critical
  // section, so the peak never exceeds the budget (checked and counted under separate locks, two threads could both
  // see room for one block and both take it).
  auto& meter = sbp::CpuMemoryMeter::install();
  constexpr std::int64_t kBlock = 1 << 16;
  const auto held = meter.current_bytes();
  meter.reset_peak();
  meter.set_budget_bytes(held + 3 * kBlock + kBlock / 2);
  std::atomic<int> granted{0}, refused{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) {
        try {
          auto block = at::empty({kBlock}, at::kByte);
          ++granted;
        } catch (const c10::OutOfMemoryError&) {
          ++refused;
        }
      }
    });
  for (auto& t : threads) t.join();
  meter.set_budget_bytes(0);
  INFO(granted << " blocks granted, " << refused << " refused");
  CHECK(granted > 0);
  CHECK(meter.peak_bytes() - held <= 3 * kBlock + kBlock / 2);
  CHECK(meter.current_bytes() == held);
}

TEST_CASE("a BP step over the budget ends with status oom and leaves nothing counted", "[meter][budget]") {
  auto& meter = CpuMemoryMeter::install();
  sbp::Model model(sbp::test::tiny_config(), at::kFloat, 81);
  const auto batch = sbp::random_sft_batch(model.config(), {1, 256, 0.0, 0.0, 82});
  sbp::SftObjective objective;
  auto method = sbp::make_method("standard");
  const auto base = meter.current_bytes();
  // Far below the step's logits alone ([1, 256, 512] fp32 = 512 KiB): the step cannot fit.
  const auto m = sbp::measure_method(model, *method, objective, batch, 0, 1, 64 << 10);
  CHECK(m.status == sbp::StepStatus::oom);
  CHECK_THAT(m.error, Catch::Contains("budget"));
  CHECK(meter.budget_bytes() == 0);
  CHECK(meter.current_bytes() == base);  // every block of the aborted step was freed, and uncounted
}

TEST_CASE("the meter agrees with the process RSS on a touched 256 MiB block", "[meter][rss]") {
  auto& meter = CpuMemoryMeter::install();
  const std::int64_t bytes = std::int64_t(256) << 20;
  const auto rss_before = sbp::process_rss_bytes();
  REQUIRE(rss_before > 0);
  const auto base = meter.current_bytes();
  auto block = at::empty({bytes}, at::kByte);
  block.fill_(1);  // touch every page: untouched pages of a fresh mapping are not resident
  CHECK(meter.current_bytes() - base == bytes);
  const auto rss_after = sbp::process_rss_bytes();
  // The kernel may lazily keep or drop a few unrelated pages meanwhile; 90% of the block is the robust part of the
  // claim, and the peak (VmHWM) can never be below the current RSS.
  CHECK(rss_after - rss_before >= bytes * 9 / 10);
  CHECK(rss_after - rss_before <= bytes * 11 / 10);
  CHECK(sbp::process_peak_rss_bytes() >= rss_after);
}

namespace {

// The meter's largest single block and the measured peak of one step of `spec` on B unpadded rows of T tokens.
struct StepMemory {
  std::int64_t largest_block_bytes = 0;
  sbp::Measurement measurement;
};
StepMemory step_memory(const sbp::ModelConfig& config, c10::ScalarType dtype, const std::string& spec,
                       std::int64_t T, std::int64_t B = 1, const std::string& lora = "",
                       sbp::MemoryEstimate* estimate = nullptr, bool mixed = false,
                       sbp::OffloadTier* tier = nullptr, bool offload_gradients = false) {
  sbp::Model model(config, dtype, 91);
  if (!lora.empty()) model.add_lora(sbp::parse_lora_spec(lora), 93);
  if (mixed) model.set_grad_dtype(at::kFloat);
  const auto batch = sbp::random_sft_batch(config, {B, T, 0.0, 0.0, 92});
  sbp::SftObjective objective;
  auto method = sbp::make_method(spec);
  method->offload_checkpoints_to(tier);
  sbp::Subscription offloading;
  if (tier && offload_gradients)
    offloading = method->on_gradient_ready([tier](const sbp::GradientGroup& group) { sbp::store_gradients(*tier, group.tensors); });
  StepMemory out;
  // bf16 on a CPU with native bf16 GEMMs: every intra-op worker of the flash backward takes oneDNN scratch per block
  // GEMM (2 x 354 KiB on tiny), and the model counts them at once, as a long call reaches. A short step on a busy CPU
  // sometimes misses that moment (MsT bf16-mixed at 0.963 with a compiler on both cores; MsT LoRA bf16 at 0.954 in
  // the second of two steps with a build and another suite running); the peak of four steps rarely does.
  const int repeats = dtype == at::kBFloat16 ? 4 : 1;
  out.measurement = sbp::measure_method(model, *method, objective, batch, 0, repeats, 0);
  out.largest_block_bytes = CpuMemoryMeter::install().largest_allocation_bytes();
  if (estimate) {
    auto workload = sbp::make_workload(model, objective.prepare(batch, model.config()), batch);
    if (tier && method->keeps_layer_checkpoints()) workload.add(sbp::Offload{sbp::OffloadKind::checkpoints});
    if (tier && offload_gradients) workload.add(sbp::Offload{sbp::OffloadKind::gradients});
    *estimate = method->memory_model(workload);
  }
  return out;
}

}  // namespace

using sbp::test::matches_model;

// Attention that materialises scores needs at least one head's [T, T] tile (SDPA's unfused path makes all heads'
// [B, n_h, T, T] at once). A largest block below T*T*elem therefore proves that no score matrix of even one head ever
// existed; and with fixed chunks StreamBP's largest block may grow at most linearly in T: doubling T may double it
// (the [c, T] mask tile of the last chunk), never quadruple it.
TEST_CASE("StreamBP never allocates an O(T^2) block", "[meter][streambp]") {
  const std::string spec = "streambp:layer_chunk=256,head_chunk=256";
  const std::int64_t elem = 8;  // fp64
  const auto config = sbp::test::tiny_config();
  const auto half = step_memory(config, at::kDouble, spec, 1024);
  const auto full = step_memory(config, at::kDouble, spec, 2048);
  REQUIRE(half.measurement.status == sbp::StepStatus::finished);
  REQUIRE(full.measurement.status == sbp::StepStatus::finished);
  const std::int64_t T = 2048;
  INFO("largest block at T=1024: " << half.largest_block_bytes << ", at T=2048: " << full.largest_block_bytes
                                   << "; one head's T x T scores at T=2048: " << T * T * elem);
  CHECK(full.largest_block_bytes < T * T * elem);
  CHECK(full.largest_block_bytes <= 2 * half.largest_block_bytes);
}

namespace {

// Forces SDPA's unfused (math) path for one scope: the positive control of the O(T^2) test below.
class UnfusedAttentionScope {
 public:
  UnfusedAttentionScope() : flash_(at::globalContext().userEnabledFlashSDP()) {
    at::globalContext().setSDPUseFlash(false);
  }
  ~UnfusedAttentionScope() { at::globalContext().setSDPUseFlash(flash_); }
  UnfusedAttentionScope(const UnfusedAttentionScope&) = delete;
  UnfusedAttentionScope& operator=(const UnfusedAttentionScope&) = delete;

 private:
  bool flash_;
};

}  // namespace

TEST_CASE("the meter sees the T x T score block of unfused attention", "[meter][negative-control]") {
  // Without this control, the test above could pass because the meter misses blocks, not because none exist.
  const UnfusedAttentionScope unfused;
  const std::int64_t T = 1024, elem = 8;
  const auto standard = step_memory(sbp::test::tiny_config(), at::kDouble, "standard", T);
  REQUIRE(standard.measurement.status == sbp::StepStatus::finished);
  INFO("largest block " << standard.largest_block_bytes);
  CHECK(standard.largest_block_bytes >= T * T * elem);
}

TEST_CASE("peak memory of StreamBP is linear in T", "[meter][streambp]") {
  // With fixed chunks every live tensor of StreamBP is either constant or linear in T, so the peaks at T, 2T, 3T are
  // equally spaced. Measured on torch 2.14.1: differences of 4,727,040 and 4,726,784 bytes (256 apart); 1% leaves
  // room for kernel workspaces that round with T.
  const auto config = sbp::test::tiny_config();
  std::vector<std::int64_t> peaks;
  for (const std::int64_t T : {1024, 2048, 3072}) {
    const auto m = step_memory(config, at::kDouble, "streambp:layer_chunk=128,head_chunk=128", T);
    REQUIRE(m.measurement.status == sbp::StepStatus::finished);
    peaks.push_back(m.measurement.peak_bytes);
  }
  const double first = double(peaks[1] - peaks[0]), second = double(peaks[2] - peaks[1]);
  INFO("peaks " << peaks[0] << " " << peaks[1] << " " << peaks[2] << ", differences " << first << " " << second);
  CHECK(first > 0);
  CHECK(std::abs(second - first) <= 0.01 * first);
}

TEST_CASE("the analytic memory models of LoRA and MsT runs match the measured peaks within 3 percent",
          "[meter][memory-model][mst][lora]") {
  // The same two kinds of peak as below (logits-dominated, layer-dominated), fp32 and fp64, GQA and MHA, every
  // method under LoRA (rank 8, all-linear: no base gradient exists) and MsT with full fine-tuning.
  struct Shape {
    std::int64_t vocab, T, B;
    c10::ScalarType dtype;
    std::int64_t kv_heads = 2;
  };
  for (const auto& w : {Shape{4096, 512, 2, at::kFloat}, Shape{4096, 512, 1, at::kDouble},
                        Shape{512, 2048, 1, at::kFloat}, Shape{512, 1024, 2, at::kDouble},
                        Shape{512, 2048, 1, at::kFloat, 4}, Shape{4096, 512, 1, at::kBFloat16},
                        Shape{512, 1024, 2, at::kBFloat16}}) {
    sbp::ModelConfig config = sbp::test::tiny_config();
    config.vocab_size = w.vocab;
    config.num_key_value_heads = w.kv_heads;
    struct Run {
      std::string spec, lora;
    };
    // MsT in full fine-tuning at 8 mini-sequences and its default; every method of the catalogue under LoRA.
    std::vector<Run> runs = {{"mst:mini_seq=8", ""}, {"mst", ""}};
    for (const auto& spec : sbp::metered_method_specs()) runs.push_back({spec, "rank=8"});
    for (const auto& run : runs) {
      sbp::MemoryEstimate estimate;
      const auto m = step_memory(config, w.dtype, run.spec, w.T, w.B, run.lora, &estimate);
      REQUIRE(m.measurement.status == sbp::StepStatus::finished);
      const double ratio = double(m.measurement.peak_bytes) / double(estimate.total_bytes());
      INFO(c10::toString(w.dtype) << " V=" << w.vocab << " B=" << w.B << " T=" << w.T << " " << run.spec << " lora="
                                  << run.lora << ": measured " << m.measurement.peak_bytes << ", analytic "
                                  << estimate.total_bytes() << " at " << estimate.moment << ", ratio " << ratio);
      // Issue #7. Measured/analytic on this grid (torch 2.14.1, 2 threads): 0.96 to 1.02. What closed the gap from
      // 0.92-1.05: the flash backward's per-thread scratch, the input norm's saved input being the checkpoint itself
      // in fp32/fp64, o_proj's input freed before the attention backward, one [c, I] MLP-backward gradient.
      CHECK(matches_model(m.measurement.peak_bytes, estimate));
    }
  }
}

TEST_CASE("the analytic memory models match the measured peaks within 3 percent", "[meter][memory-model]") {
  // Two tiny but not trivial workloads, one per kind of peak: with V = 4096 and T = 512 the logits dominate (the
  // head-backward moment, as with the real vocabulary); with V = 512 and T = 2048 the layer backward does. fp32, fp64
  // and bf16 (fp32 sums of streamed gradients, fp32 logits), GQA and MHA. Measured/analytic on this grid (torch
  // 2.14.1, 2 threads): 0.96 to 1.03, the low end StreamBP's layer moment with 64-token chunks (issue #9 asks 3%;
  // results/grid has the wider grid). Not checked here: an MHA config with d = 256, head_dim = 64 at T = 1024 (StreamBP
  // with 64-token chunks and checkpointing under LoRA were +5.4-5.8% before the final-norm fix).
  struct Shape {
    std::int64_t vocab, T, B;
    c10::ScalarType dtype;
    std::int64_t kv_heads = 2;
  };
  for (const auto& w : {Shape{4096, 512, 2, at::kFloat}, Shape{4096, 512, 1, at::kDouble},
                        Shape{512, 2048, 1, at::kFloat}, Shape{4096, 512, 2, at::kBFloat16},
                        Shape{512, 2048, 1, at::kBFloat16}, Shape{512, 1024, 2, at::kBFloat16, 4}}) {
    sbp::ModelConfig config = sbp::test::tiny_config();
    config.vocab_size = w.vocab;
    config.num_key_value_heads = w.kv_heads;
    for (const auto& spec : sbp::metered_method_specs()) {
      sbp::MemoryEstimate estimate;
      const auto m = step_memory(config, w.dtype, spec, w.T, w.B, "", &estimate);
      REQUIRE(m.measurement.status == sbp::StepStatus::finished);
      const double ratio = double(m.measurement.peak_bytes) / double(estimate.total_bytes());
      INFO(c10::toString(w.dtype) << " V=" << w.vocab << " B=" << w.B << " T=" << w.T << " kv=" << w.kv_heads << " "
                                  << spec << ": measured " << m.measurement.peak_bytes << ", analytic "
                                  << estimate.total_bytes() << " at " << estimate.moment << ", ratio " << ratio);
      CHECK(matches_model(m.measurement.peak_bytes, estimate));
    }
  }
}

TEST_CASE("standard BP's memory model holds at the end of a short step, when every gradient exists",
          "[meter][memory-model]") {
  // Issue #9's case: tiny, B = 1, T = 2 measured 979 KiB against a model of 503 KiB, which had only the head moment.
  // The end of the backward (all gradients, the embedding's dense gradient) is the peak here: measured/model 1.000
  // tied and untied, fp32/fp64/bf16.
  for (const bool tied : {true, false})
    for (const auto dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
      sbp::ModelConfig config = sbp::test::tiny_config();
      config.tie_word_embeddings = tied;
      sbp::MemoryEstimate estimate;
      const auto m = step_memory(config, dtype, "standard", 2, 1, "", &estimate);
      REQUIRE(m.measurement.status == sbp::StepStatus::finished);
      const double ratio = double(m.measurement.peak_bytes) / double(estimate.total_bytes());
      INFO(c10::toString(dtype) << " tied=" << tied << ": measured " << m.measurement.peak_bytes << ", analytic "
                                << estimate.total_bytes() << " at " << estimate.moment << ", ratio " << ratio);
      CHECK(matches_model(m.measurement.peak_bytes, estimate));
    }
}

TEST_CASE("the analytic memory models hold in mixed precision within 3 percent", "[meter][memory-model][mixed]") {
  // bf16 compute with fp32 masters and gradients (--grad-dtype fp32): the masters' compute-dtype copies that each
  // graph keeps, fp32 gradients that are their own chunk sums, no lm_head commit. Full fine-tuning and LoRA (fp32
  // adapters on a bf16 base, the paper's LoRA setting), both kinds of peak, GQA and MHA; and standard BP's
  // end-of-backward moment (T = 2), tied and untied.
  struct Shape {
    std::int64_t vocab, T, B;
    std::int64_t kv_heads = 2;
    bool tied = true;
  };
  for (const auto& w : {Shape{4096, 512, 2}, Shape{512, 2048, 1}, Shape{512, 1024, 2, 4}, Shape{4096, 2, 1, 2, true},
                        Shape{4096, 2, 1, 2, false}}) {
    sbp::ModelConfig config = sbp::test::tiny_config();
    config.vocab_size = w.vocab;
    config.num_key_value_heads = w.kv_heads;
    config.tie_word_embeddings = w.tied;
    for (const std::string lora : {"", "rank=8"})
      for (const auto& spec : sbp::metered_method_specs()) {
        if (w.T == 2 && (spec != "standard" || !lora.empty())) continue;
        sbp::MemoryEstimate estimate;
        const auto m = step_memory(config, at::kBFloat16, spec, w.T, w.B, lora, &estimate, /*mixed=*/true);
        REQUIRE(m.measurement.status == sbp::StepStatus::finished);
        const double ratio = double(m.measurement.peak_bytes) / double(estimate.total_bytes());
        INFO("bf16-mixed V=" << w.vocab << " B=" << w.B << " T=" << w.T << " kv=" << w.kv_heads << " tied=" << w.tied
                             << " " << spec << " lora=" << lora << ": measured " << m.measurement.peak_bytes
                             << ", analytic " << estimate.total_bytes() << " at " << estimate.moment << ", ratio " << ratio);
        CHECK(matches_model(m.measurement.peak_bytes, estimate));
      }
  }
}

TEST_CASE("the memory models hold under whatever kernels the CPU configuration picks", "[meter][memory-model][kernels]") {
  // What a lowered CPU configuration changes (CTest runs this under ONEDNN_MAX_CPU_ISA=AVX512_CORE and AVX2, issue #28)
  // is which kernel runs a product and what scratch it takes: oneDNN's native bf16 brgemm, its fp32-buffered emulation,
  // ATen's loop, or the widened fp32 path (core/model/gemm.h), and the attention kernel's block GEMMs. The models take
  // those from the calibration's probes; this is the smallest grid that exercises every probed call: each method at
  // both kinds of peak (logits: V = 4096, T = 512; layers: V = 512, T = 2048) in bf16, mixed precision with LoRA, and
  // one fp32 run. The full grids run natively (the other [memory-model] cases).
  struct Run {
    std::int64_t vocab, T, B;
    c10::ScalarType dtype;
    bool mixed;
    std::string lora;
  };
  for (const auto& r : {Run{4096, 512, 2, at::kBFloat16, false, ""}, Run{512, 2048, 1, at::kBFloat16, false, ""},
                        Run{512, 1024, 2, at::kBFloat16, true, "rank=8"}, Run{4096, 512, 1, at::kFloat, false, ""}}) {
    sbp::ModelConfig config = sbp::test::tiny_config();
    config.vocab_size = r.vocab;
    for (const auto& spec : sbp::metered_method_specs()) {
      sbp::MemoryEstimate estimate;
      const auto m = step_memory(config, r.dtype, spec, r.T, r.B, r.lora, &estimate, r.mixed);
      REQUIRE(m.measurement.status == sbp::StepStatus::finished);
      INFO(c10::toString(r.dtype) << (r.mixed ? "-mixed" : "") << " V=" << r.vocab << " B=" << r.B << " T=" << r.T << " "
                                  << spec << " lora=" << r.lora << ": measured " << m.measurement.peak_bytes
                                  << ", analytic " << estimate.total_bytes() << " at " << estimate.moment << ", ratio "
                                  << double(m.measurement.peak_bytes) / double(estimate.total_bytes()));
      CHECK(matches_model(m.measurement.peak_bytes, estimate));
    }
  }
}

TEST_CASE("the analytic memory models hold on the device with the checkpoints and gradients offloaded, within 3 "
          "percent", "[meter][memory-model][offload]") {
  // The tier's files are outside the meter's pool: what it sees is the device's. Both kinds of peak (logits: V = 4096,
  // T = 512; layers: V = 512, T = 2048), fp32 and bf16, full and LoRA, every method of the catalogue: those that keep
  // checkpoints with them offloaded (on the device only the checkpoint in use and the one fetched ahead of it) and
  // then with the gradients too (a group's leave at its event); standard BP with its gradients offloaded.
  const sbp::test::TempDir dir("sbp_meter_offload_");
  struct Shape {
    std::int64_t vocab, T, B;
    c10::ScalarType dtype;
  };
  for (const auto& w : {Shape{4096, 512, 2, at::kFloat}, Shape{512, 2048, 1, at::kFloat}, Shape{512, 1024, 2, at::kBFloat16}}) {
    sbp::ModelConfig config = sbp::test::tiny_config();
    config.vocab_size = w.vocab;
    for (const std::string lora : {"", "rank=8"})
      for (const auto& spec : sbp::metered_method_specs())
        for (const bool gradients : {false, true}) {
          if (!gradients && !sbp::make_method(spec)->keeps_layer_checkpoints()) continue;
          const auto tier = sbp::make_file_tier(dir.path().string());
          sbp::MemoryEstimate estimate;
          const auto m = step_memory(config, w.dtype, spec, w.T, w.B, lora, &estimate, false, tier.get(), gradients);
          REQUIRE(m.measurement.status == sbp::StepStatus::finished);
          INFO(c10::toString(w.dtype) << " V=" << w.vocab << " B=" << w.B << " T=" << w.T << " " << spec << " lora="
                                      << lora << " gradients=" << gradients << ": measured " << m.measurement.peak_bytes << ", analytic "
                                      << estimate.total_bytes() << " at " << estimate.moment << ", ratio "
                                      << double(m.measurement.peak_bytes) / double(estimate.total_bytes()));
          CHECK(matches_model(m.measurement.peak_bytes, estimate));
          CHECK(tier->peak_bytes() == estimate.host_bytes());
        }
  }
}

TEST_CASE("the memory timeline's categories follow the phase that allocated a block and its lifetime",
          "[meter][profile]") {
  // Two steps over synthetic events: a block from before the timeline (weights), a forward block that outlives the
  // forward (checkpoint), a forward temporary, K/V, a head buffer, and a block alive at its step's end (gradient)
  // that the next step frees.
  using E = sbp::MemoryEvent;
  const std::vector<E> events = {
      {0.0, 100, "forward", 1, +10},   // checkpoint: dies after the forward
      {0.1, 120, "forward", 2, +20},   // temporary: dies in the forward
      {0.2, 100, "forward", 2, -20},
      {0.3, 105, "kv_recompute", 3, +5},
      {0.4, 112, "head", 4, +7},
      {0.5, 105, "head", 4, -7},
      {0.6, 100, "layer", 3, -5},
      {0.7, 140, "layer", 5, +40},  // gradient: alive when step 1 ends (event 9)
      {0.8, 130, "layer", 1, -10},
      // step 2
      {0.9, 90, "forward", 5, -40},   // zero_grad frees step 1's gradient
      {1.0, 40, "forward", 99, -50},  // a block from before the timeline (part of the weights)
  };
  const std::int64_t before = 90;
  const auto out = sbp::categorize_timeline(events, before, {9, 11});
  REQUIRE(out.size() == events.size());
  enum { W, G, C, KV, H, WS };
  for (const auto& e : out) {
    std::int64_t sum = 0;
    for (const auto b : e.live) sum += b;
    CHECK(sum == e.current_bytes);
  }
  CHECK(out[0].live[C] == 10);
  CHECK(out[1].live[WS] == 20);
  CHECK(out[3].live[KV] == 5);
  CHECK(out[4].live[H] == 7);
  CHECK(out[7].live[G] == 40);
  CHECK(out[8].live[C] == 0);
  CHECK(out[9].live[G] == 0);
  CHECK(out[10].live[W] == 40);
  CHECK(out[0].live[W] == 90);
  CHECK_THROWS(sbp::categorize_timeline(events, before, {12}));
}
