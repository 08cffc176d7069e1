// The per-rank memory model of data-parallel training (ARCHITECTURE.md §12, ZeRO 0-3) against the CPU meter. The meter counts
// the whole process's allocations, so ranks as threads of one process would add up. Here one process is one rank: a
// Communicator whose N ranks are all this one (tests/support/identical_ranks.h) gives the collectives their results' shapes and
// allocates what Gloo's allocate through the CPU allocator, so the meter sees exactly one rank's bytes. That it does
// is checked against real Gloo ranks (separate processes) in tests/cli_zero_memory.sh.
#include <catch2/catch.hpp>

#include <cmath>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "baselines/methods.h"
#include "core/methods/memory_model.h"
#include "core/training/training_memory.h"
#include "core/model/lora.h"
#include "core/model/model.h"
#include "core/model/sequence_shard.h"
#include "core/objectives/length_distribution.h"
#include "core/objectives/packed_batch.h"
#include "core/offload/offload_tier.h"
#include "core/objectives/sft.h"
#include "core/training/data_parallel.h"
#include "core/training/trainer.h"
#include "experiments/batches.h"
#include "experiments/measure.h"
#include "profiler/cpu_meter.h"
#include "tests/support/identical_ranks.h"
#include "tests/support/test_support.h"

namespace {

struct Measured {
  std::int64_t peak = 0;
  sbp::MemoryEstimate model, single_process_model;
  // Sequence parallelism's negative control: one process's model of a sequence as long as the rank's shard (the
  // gathered K/V, the blocks' outputs and the loss's blocks ignored).
  sbp::MemoryEstimate shard_as_sequence_model;
  // The ring's negative control: the all-gather's model of the same step (the whole sequence's K/V and sums).
  sbp::MemoryEstimate allgather_model;
  // Packed rows' negative control: the model of the same step blind to the boundaries (one sequence of T per row).
  sbp::MemoryEstimate unpacked_model;
};

// Rank 0 of `world` ranks at ZeRO `stage` (rank 0's slices are the longest: the model is of it), AdamW steps of the
// method on this rank's rows; the peak of all but the first (which allocates nothing more, but is not counted).
// world 1: one process, no DataParallel (its parameters offloaded through the Trainer's ParameterHome).
// What moves to the offload tier (issue #31).
struct Offload {
  bool checkpoints = false, optimizer = false, gradients = false, parameters = false;
};

Measured measure_rank(const std::string& spec, const std::string& lora, std::int64_t vocab, std::int64_t T, int world,
                      int stage, c10::ScalarType dtype = at::kFloat, sbp::OffloadTier* tier = nullptr,
                      Offload offload = {}, int sp = 1,
                      sbp::SequenceScheme scheme = sbp::SequenceScheme::allgather,
                      const std::string& preset = "tiny", const std::string& pack = "") {
  auto& meter = sbp::CpuMemoryMeter::install();
  auto config = sbp::preset_config(preset);
  config.vocab_size = vocab;
  sbp::Model model(config, dtype, 91);
  if (!lora.empty()) model.add_lora(sbp::parse_lora_spec(lora), 93);
  sbp::RandomBatchOptions batch_options{2, T, 0.0, 0.1, 92};
  if (!pack.empty()) batch_options.pack = sbp::LengthDistribution::parse(pack);
  const auto batch = pack.empty() ? sbp::random_sft_batch(config, batch_options)
                                   : sbp::random_packed_sft_batch(config, batch_options);
  auto method = sbp::make_method(spec);
  if (offload.checkpoints) method->offload_checkpoints_to(tier);
  sbp::SftObjective objective;
  sbp::TrainOptions options;
  options.optimizer = sbp::parse_optimizer_spec("adamw:lr=1e-3,weight_decay=0.1");
  // bf16: the peak of several steps (the attention backward's per-worker scratch, see test_meter.cpp).
  const int steps = dtype == at::kBFloat16 ? 4 : 3;
  options.total_steps = steps;
  options.clip_grad_norm = 0.5;
  if (offload.optimizer) options.optimizer_tier = tier;
  if (offload.gradients) options.gradient_tier = tier;
  sbp::test::IdenticalRanks ranks(world, 0);
  // Sequence parallelism: rank 0 of a group of sp (its K/V gathers and reduce-scatters allocate what Gloo's do).
  sbp::test::IdenticalRanks sequence(sp, 0);
  if (sp > 1) options.sequence_group = &sequence;
  options.sequence_scheme = scheme;
  std::optional<sbp::DataParallel> parallel;
  if (world > 1)
    parallel.emplace(ranks, stage, offload.parameters ? tier : nullptr);
  else if (offload.parameters)
    options.parameter_tier = tier;
  sbp::Trainer trainer(model, *method, objective, options, parallel ? &*parallel : nullptr);
  auto workload = sbp::make_workload(model, objective.prepare(batch, config), batch);
  if (tier && offload.checkpoints) workload.add(sbp::Offload{sbp::OffloadKind::checkpoints});
  if (tier && offload.optimizer) workload.add(sbp::Offload{sbp::OffloadKind::optimizer});
  if (tier && offload.gradients) workload.add(sbp::Offload{sbp::OffloadKind::gradients});
  if (tier && offload.parameters) workload.add(sbp::Offload{sbp::OffloadKind::parameters});
  workload.add(sbp::SequenceParallelism{sp, scheme});
  auto single = workload;
  trainer.add_optimizer_memory(workload);
  sbp::add_optimizer_memory(single, model, options.optimizer);  // the negative control: one process's model
  Measured out{0, sbp::training_memory(*method, workload), sbp::training_memory(*method, single), {}};
  if (sp > 1) {
    auto shard = workload;
    shard.seq_len = sbp::longest_zigzag_shard(T, sp);
    shard.remove_sequence_parallelism();
    out.shard_as_sequence_model = sbp::training_memory(*method, shard);
    auto gathered = workload;
    gathered.add(sbp::SequenceParallelism{sp, sbp::SequenceScheme::allgather});
    out.allgather_model = sbp::training_memory(*method, gathered);
  }
  if (workload.packed) {
    auto blind = workload;
    blind.packed.reset();
    out.unpacked_model = sbp::training_memory(*method, blind);
  }
  // ZeRO-3: the model's trainable tensors are empty between steps; the rank's parameters are its slices, which the
  // trainer holds (held_bytes, with the optimizer's states).
  const auto weights = sbp::model_weight_bytes(model);
  for (int s = 0; s < steps; ++s) {
    model.zero_grad();
    meter.reset_peak();
    // Held before the step but not the model's: the batch and what else the test keeps.
    const auto held = meter.current_bytes() - weights - trainer.held_bytes();
    trainer.step(batch);
    if (s > 0) out.peak = std::max(out.peak, meter.peak_bytes() - held);
  }
  return out;
}

std::string describe(const sbp::MemoryEstimate& e) {
  std::string text = e.moment + ":";
  for (const auto& t : e.terms) text += " " + t.name + " " + std::to_string(t.bytes) + ";";
  return text;
}

}  // namespace

TEST_CASE("per-rank memory models of data-parallel training steps (ZeRO 0-3, 2 and 3 ranks, StreamBP and "
          "checkpointing, full and LoRA) match the measured peaks within 3 percent", "[training][meter][memory-model]") {
  // Three shapes: at T = 16 the peak is a gradient group's collective (V = 512: a layer's; V = 4096: the
  // embedding's) or around the update (the optimizer step, the gradient norm over the slices, the all-gather of the
  // updated slices); at V = 512, T = 256 it is in the BP, with the gradients of the reduced groups sharded (stages
  // 2-3) and one layer's parameters gathered (stage 3).
  struct Shape {
    std::int64_t vocab, T;
  };
  int negative_controls = 0;
  double worst = 0, closest_control = 1e9;  // the largest |measured / model - 1|; the smallest of the controls'
  for (const auto& shape : {Shape{512, 16}, Shape{4096, 16}, Shape{512, 256}})
    for (const int world : {2, 3})
      for (const int stage : {0, 1, 2, 3})
        for (const std::string spec : {"streambp:layer_chunk=64,head_chunk=64", "checkpoint"})
          for (const std::string lora : {"", "rank=8"}) {
            const auto m = measure_rank(spec, lora, shape.vocab, shape.T, world, stage);
            const double ratio = double(m.peak) / double(m.model.total_bytes());
            const double single_ratio = double(m.peak) / double(m.single_process_model.total_bytes());
            INFO("V=" << shape.vocab << " T=" << shape.T << " world " << world << " ZeRO " << stage << " " << spec
                      << " lora=" << lora << ": measured " << m.peak << ", model " << m.model.total_bytes()
                      << " (ratio " << ratio << ") at " << describe(m.model) << " one process's model: ratio "
                      << single_ratio);
            CHECK(std::abs(ratio - 1.0) <= 0.03);
            worst = std::max(worst, std::abs(ratio - 1.0));
            // Negative control: the model of one process (the world size ignored) misses the sharding by far more
            // than the tolerance wherever the optimizer's states are sharded and dominate (full fine-tuning; LoRA's
            // adapters and their states are a few KiB beside the frozen base; at V = 4096 the embedding's gradient
            // collective is the peak, and the one-process model's own peak came within 2.6% of it at ZeRO 2 once
            // AdamW's update ran in slices).
            if (world == 3 && stage >= 1 && lora.empty() && shape.vocab == 512) {
              CHECK(std::abs(single_ratio - 1.0) > 0.03);
              closest_control = std::min(closest_control, std::abs(single_ratio - 1.0));
              ++negative_controls;
            }
          }
  CHECK(negative_controls == 2 * 3 * 2);
  WARN("largest |measured / model - 1| over 96 runs: " << worst << "; the one-process model's smallest miss at "
       "ZeRO 1-3 over 3 ranks: " << closest_control);
}

TEST_CASE("per-rank memory models of data-parallel training steps in pure bf16 (the paper's full training: bf16 "
          "weights, gradients and AdamW states) match the measured peaks within 3 percent",
          "[training][meter][memory-model]") {
  struct Shape {
    std::int64_t vocab, T;
  };
  double worst = 0;
  int runs = 0;
  // Three ranks only (two are in the fp32 case): bf16 steps are slow on a CPU without native bf16.
  for (const auto& shape : {Shape{512, 16}, Shape{512, 256}})
    for (const int world : {3})
      for (const int stage : {0, 1, 2, 3})
        for (const std::string spec : {"streambp:layer_chunk=64,head_chunk=64", "checkpoint"}) {
          // Not checkpointing at T = 16: with native bf16 GEMMs its own (one-process) model is 2.6% under there at
          // layer 0's down_proj weight-gradient moment (ZeRO 0; 2.4% at ZeRO-3's reduction), too close to the
          // tolerance to hold on every CPU (STREAMBP_NARROW_GEMM=native on an AVX512-BF16 EPYC; 1.3% widened).
          if (spec == "checkpoint" && shape.T == 16) continue;
          ++runs;
          const auto m = measure_rank(spec, "", shape.vocab, shape.T, world, stage, at::kBFloat16);
          const double ratio = double(m.peak) / double(m.model.total_bytes());
          INFO("bf16 V=" << shape.vocab << " T=" << shape.T << " world " << world << " ZeRO " << stage << " " << spec
                         << ": measured " << m.peak << ", model " << m.model.total_bytes() << " (ratio " << ratio
                         << ") at " << describe(m.model));
          CHECK(std::abs(ratio - 1.0) <= 0.03);
          worst = std::max(worst, std::abs(ratio - 1.0));
        }
  WARN("bf16: largest |measured / model - 1| over " << runs << " runs: " << worst);
}

TEST_CASE("per-rank memory models of data-parallel training with the checkpoints, the gradients, the optimizer's "
          "states and (ZeRO-3) the parameter slices offloaded (ZeRO 0-3, 2 and 3 ranks, every method, fp32 and bf16, "
          "full and LoRA) hold on the device within 3 percent, the tier to the byte",
          "[training][meter][memory-model][offload]") {
  // V = 512, T = 256: the peak is in the BP, where the checkpoints are, beside the sharded gradients (stages 2-3) and
  // one gathered layer (stage 3); V = 4096, T = 16: around the update, where the states and gradients are, or the
  // lm_head's backward GEMMs. Every rank its own tier. bf16 by matches_model (the attention scratch's timing).
  // LoRA or not alternates with the stage, the method and the dtype (every pair of the four meets, at half the runs of
  // the full product: this grid was the suite's longest test at 157 s).
  const sbp::test::TempDir dir("sbp_zero_offload_");
  const auto specs = sbp::metered_method_specs();
  double worst = 0;
  int runs = 0;
  for (const auto dtype : {at::kFloat, at::kBFloat16})
    for (const auto& [vocab, T] : std::vector<std::pair<std::int64_t, std::int64_t>>{{512, 256}, {4096, 16}})
      for (const auto& offload : {Offload{true, false, false}, Offload{false, true, false}, Offload{true, true, false},
                                  Offload{false, false, true}, Offload{true, true, true}, Offload{false, false, false, true},
                                  Offload{true, true, true, true}})
        for (const int stage : {0, 1, 2, 3})
          for (std::size_t method = 0; method < specs.size(); ++method) {
            const auto& spec = specs[method];
            const std::string lora = (stage + method + (dtype == at::kFloat)) % 2 ? "rank=8" : "";
            // Nothing moves near the update; the gradients alone near the checkpoints change little.
            if (vocab == 4096 && offload.checkpoints && !offload.optimizer) continue;
            // Standard BP keeps no checkpoints: its sets are the others.
            if (offload.checkpoints && !sbp::make_method(spec)->keeps_layer_checkpoints()) continue;
            if (offload.parameters && stage != 3) continue;  // the parameters move as ZeRO-3's slices
            const auto tier = sbp::make_file_tier(dir.path().string());
            const auto m = measure_rank(spec, lora, vocab, T, 2, stage, dtype, tier.get(), offload);
            const double ratio = double(m.peak) / double(m.model.total_bytes());
            INFO(c10::toString(dtype) << " V=" << vocab << " T=" << T << " offload checkpoints=" << offload.checkpoints
                                      << " optimizer=" << offload.optimizer << " gradients=" << offload.gradients
                                      << " parameters=" << offload.parameters << " ZeRO " << stage << " " << spec
                                      << " lora=" << lora << ": measured " << m.peak << ", model "
                                      << m.model.total_bytes() << " (ratio " << ratio << ") at " << describe(m.model)
                                      << "; tier " << tier->peak_bytes() << ", model " << m.model.host_bytes());
            CHECK(sbp::test::matches_model(m.peak, m.model));
            CHECK(tier->peak_bytes() == m.model.host_bytes());
            worst = std::max(worst, std::abs(ratio - 1.0));
            ++runs;
          }
  // Three ranks, everything offloaded (the parameters at ZeRO-3): slices no longer split every tensor evenly, and the
  // model counts a group's slice as a whole (memory_terms.h, slice_elements): the tier may hold up to N - 1 elements
  // per tensor more than it says, the analytic bound checked here.
  for (const int stage : {0, 1, 2, 3})
    for (const std::string spec : {"streambp:layer_chunk=64,head_chunk=64", "checkpoint", "mst:mini_seq=8"}) {
      const auto tier = sbp::make_file_tier(dir.path().string());
      const auto m = measure_rank(spec, "", 512, 256, 3, stage, at::kFloat, tier.get(), {true, true, true, stage == 3});
      const double ratio = double(m.peak) / double(m.model.total_bytes());
      const auto tensors = std::int64_t(sbp::Model(sbp::test::tiny_config(), at::kFloat, 1).trainable().size());
      INFO("3 ranks ZeRO " << stage << " " << spec << ": measured " << m.peak << ", model " << m.model.total_bytes()
                           << " (ratio " << ratio << ") at " << describe(m.model) << "; tier " << tier->peak_bytes()
                           << ", model " << m.model.host_bytes());
      CHECK(std::abs(ratio - 1.0) <= 0.03);
      CHECK(tier->peak_bytes() >= m.model.host_bytes());
      CHECK(tier->peak_bytes() - m.model.host_bytes() <= 2 * tensors * 2 * 4);  // gradients' and parameters' slices
      worst = std::max(worst, std::abs(ratio - 1.0));
      ++runs;
    }
  WARN("offload, 2 and 3 ranks: largest |measured / model - 1| over " << runs << " runs: " << worst);
}


TEST_CASE("one process's training with its parameters (and everything else) offloaded holds on the device within 3 "
          "percent of its model, the tier to the byte", "[offload][training][meter][memory-model]") {
  // V = 512, T = 256: the peak in the BP; V = 4096, T = 16: the lm_head's backward GEMMs (standard BP, checkpointing)
  // or around the update. matches_model: in bf16 the attention backward's per-worker scratch makes a step's peak
  // depend on how the workers overlapped (MsT read 3.4% low here in a CI run).
  const sbp::test::TempDir dir("sbp_offload_params_");
  for (const auto& [vocab, T] : std::vector<std::pair<std::int64_t, std::int64_t>>{{512, 256}, {4096, 16}})
    for (const auto dtype : {at::kFloat, at::kBFloat16})
      for (const std::string lora : {"", "rank=8"})
        for (const auto& spec : sbp::metered_method_specs()) {
          const bool keeps = sbp::make_method(spec)->keeps_layer_checkpoints();
          for (const auto& offload : {Offload{false, false, false, true}, Offload{keeps, true, true, true}}) {
            const auto tier = sbp::make_file_tier(dir.path().string());
            const auto m = measure_rank(spec, lora, vocab, T, 1, 0, dtype, tier.get(), offload);
            const double ratio = double(m.peak) / double(m.model.total_bytes());
            INFO(c10::toString(dtype) << " V=" << vocab << " T=" << T << " " << spec << " lora=" << lora
                                      << " everything=" << offload.optimizer << ": measured " << m.peak << ", model "
                                      << m.model.total_bytes() << " (ratio " << ratio << ") at " << describe(m.model)
                                      << "; tier " << tier->peak_bytes() << ", model " << m.model.host_bytes());
            CHECK(sbp::test::matches_model(m.peak, m.model));
            CHECK(tier->peak_bytes() == m.model.host_bytes());
          }
        }
}

// (No semicolon in a test's name: CTest's discovery splits names on it, and the pieces match no test.)
TEST_CASE("per-rank memory models of sequence-parallel training steps (StreamBP inside each rank, N = 2, 3, 4, DP x "
          "SP with ZeRO-1 and ZeRO-3, fp32 and bf16, full and LoRA) match the measured peaks within 3 percent",
          "[training][meter][memory-model][sequence-parallel]") {
  struct Layout {
    int sp, world, stage;
  };
  struct Shape {
    std::int64_t T;
    std::string spec;
  };
  double worst = 0;
  int runs = 0;
  std::set<std::string> peaks;  // the moments the models put the peaks at
  double closest_control = 1e9;
  int controls = 0;
  // T = 512: a layer's last chunk is the peak; T = 2048 with small chunks: the K/V exchange's buffers are. LoRA or not
  // alternates with the layout and the dtype (each pair meets; half the runs of the full product).
  const std::vector<Layout> layouts{{2, 2, 0}, {3, 3, 0}, {4, 4, 1}, {2, 4, 3}};
  for (const auto& shape : {Shape{512, "streambp:layer_chunk=64,head_chunk=64"},
                            Shape{2048, "streambp:layer_chunk=16,head_chunk=256"}})
  for (std::size_t l = 0; l < layouts.size(); ++l)
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
      const auto& layout = layouts[l];
      const std::string lora = (l + (dtype == at::kFloat) + (shape.T == 512)) % 2 ? "rank=8" : "";
      ++runs;
      const auto m = measure_rank(shape.spec, lora, 512, shape.T, layout.world, layout.stage, dtype, nullptr, {},
                                  layout.sp);
      peaks.insert(m.model.moment.substr(m.model.moment.find(' ', 6) + 1));
      const double ratio = double(m.peak) / double(m.model.total_bytes());
      INFO("T " << shape.T << " " << shape.spec << " SP " << layout.sp << " world " << layout.world << " ZeRO " << layout.stage << " " << c10::toString(dtype)
                 << " lora=" << lora << ": measured " << m.peak << ", model " << m.model.total_bytes() << " (ratio "
                 << ratio << ") at " << describe(m.model));
      CHECK(sbp::test::matches_model(m.peak, m.model));
      worst = std::max(worst, std::abs(ratio - 1.0));
      // Negative control: where the K/V dominate (T = 2048, small chunks), a model that sizes its whole-sequence
      // terms by the rank's shard (the K/V a rank would hold if it attended its own positions only) misses by more
      // than the tolerance.
      const double shard = double(sbp::longest_zigzag_shard(shape.T, layout.sp)) / double(shape.T);
      std::int64_t whole = 0;
      for (const auto& t : m.model.terms)
        if (t.whole_sequence) whole += t.bytes;
      if (shape.T == 2048 && whole > 0) {
        const double control = double(m.peak) / (double(m.model.total_bytes()) - double(whole) * (1 - shard));
        CHECK(std::abs(control - 1.0) > 0.03);
        closest_control = std::min(closest_control, std::abs(control - 1.0));
        ++controls;
      }
    }
  CHECK(controls >= 4);  // the T = 2048 runs whose peak holds the whole sequence's K/V (the others': the head's)
  std::string moments;
  for (const auto& p : peaks) moments += (moments.empty() ? "" : ", ") + p;
  WARN("sequence parallelism: largest |measured / model - 1| over " << runs << " runs: " << worst << "; peaks at "
       << moments << "; with K/V of the shard's size (" << controls << " runs) the smallest miss: " << closest_control);
}

TEST_CASE("per-rank memory models of sequence-parallel training steps with standard BP and checkpointing inside each "
          "rank (N = 2, 3, 4, DP x SP with ZeRO-1 and ZeRO-3, fp32 and bf16, full and LoRA) match the measured peaks "
          "within 3 percent",
          "[training][meter][memory-model][sequence-parallel]") {
  struct Layout {
    int sp, world, stage;
  };
  double worst = 0, closest_control = 1e9;
  int runs = 0, controls = 0;
  std::set<std::string> peaks;
  // T = 512 and 2048 over the layouts and dtypes; LoRA or not alternates with them (each pair of factors meets).
  // Standard BP peaks at the loss (all layers' graphs, the gathered K/V among them), checkpointing in a layer's
  // re-forward backward.
  const std::vector<Layout> layouts{{2, 2, 0}, {3, 3, 0}, {4, 4, 1}, {2, 4, 3}};
  for (const std::string spec : {"standard", "checkpoint"})
    for (const std::int64_t T : {512, 2048})
      for (std::size_t l = 0; l < layouts.size(); ++l)
        for (const auto dtype : {at::kFloat, at::kBFloat16}) {
          const auto& layout = layouts[l];
          const std::string lora = (l + (dtype == at::kFloat) + (T == 512)) % 2 ? "rank=8" : "";
          ++runs;
          const auto m = measure_rank(spec, lora, 512, T, layout.world, layout.stage, dtype, nullptr, {}, layout.sp);
          peaks.insert(spec + ": " + m.model.moment);
          const double ratio = double(m.peak) / double(m.model.total_bytes());
          const double control = double(m.peak) / double(m.shard_as_sequence_model.total_bytes());
          INFO(spec << " T " << T << " SP " << layout.sp << " world " << layout.world << " ZeRO " << layout.stage << " "
                    << c10::toString(dtype) << " lora=" << lora << ": measured " << m.peak << ", model "
                    << m.model.total_bytes() << " (ratio " << ratio << ") at " << describe(m.model)
                    << "; a process of the shard's length: ratio " << control);
          CHECK(sbp::test::matches_model(m.peak, m.model));
          worst = std::max(worst, std::abs(ratio - 1.0));
          closest_control = std::min(closest_control, std::abs(control - 1.0));
          if (std::abs(control - 1.0) > 0.03) ++controls;
        }
  // Negative control: one process's model over the shard's positions (the whole sequence's K/V, the blocks' outputs,
  // the loss's blocks and the blocks' attention backward ignored) misses by more than the tolerance on most runs:
  // 19 of 32 when written (by 3.2-13%); the others are standard BP at small N, whose peak the logits dominate.
  CHECK(controls >= runs / 2);
  std::string moments;
  for (const auto& p : peaks) moments += (moments.empty() ? "" : ", ") + p;
  WARN("sequence parallelism, standard BP and checkpointing: largest |measured / model - 1| over " << runs << " runs: "
       << worst << "; peaks at " << moments << "; one process's model of the shard missed by > 3% on " << controls
       << " runs (closest " << closest_control << ")");
}

TEST_CASE("the ring's per-rank memory model (StreamBP inside each rank, N = 2 and 3, fp64, bf16 and LoRA) matches the "
          "measured peaks within 3 percent, and without its in-flight block or as the all-gather's it misses",
          "[training][meter][memory-model][sequence-parallel][ring]") {
  struct Point {
    std::int64_t T;
    std::string spec;
    int sp;
    c10::ScalarType dtype;
    std::string lora;
  };
  double worst = 0;
  int controls = 0;
  // T = 512: a layer's chunks are the larger part; T = 2048 with small chunks: the ring's blocks and the rank's
  // queries, merged outputs and dO/dQ are. bf16 (fp32 merges, sums and tiles) and LoRA (no fresh weight gradients)
  // at both.
  const std::string wide = "streambp:layer_chunk=64,head_chunk=64", narrow = "streambp:layer_chunk=16,head_chunk=256";
  const std::vector<Point> points = {{512, wide, 2, at::kDouble, ""},
                                     {512, wide, 3, at::kDouble, ""},
                                     {2048, narrow, 2, at::kDouble, ""},
                                     {2048, narrow, 3, at::kDouble, ""},
                                     {512, wide, 2, at::kBFloat16, ""},
                                     {2048, "streambp:layer_chunk=16,head_chunk=64", 3, at::kBFloat16, ""},
                                     {512, wide, 2, at::kDouble, "rank=8"},
                                     {512, wide, 2, at::kBFloat16, "rank=8"},
                                     {2048, "streambp:layer_chunk=16,head_chunk=64", 3, at::kBFloat16, "rank=8"}};
  for (const auto& p : points) {
    const auto m = measure_rank(p.spec, p.lora, 512, p.T, p.sp, 0, p.dtype, nullptr, {}, p.sp, sbp::SequenceScheme::ring);
    const double ratio = double(m.peak) / double(m.model.total_bytes());
    const double allgather = double(m.peak) / double(m.allgather_model.total_bytes());
    std::int64_t in_flight = 0;  // negative control: the model with the block in flight dropped
    for (const auto& t : m.model.terms)
      if (t.name.find("in flight") != std::string::npos || t.name.find("block received") != std::string::npos)
        in_flight += t.bytes;
    const double dropped = double(m.peak) / double(m.model.total_bytes() - in_flight);
    INFO("T " << p.T << " " << p.spec << " " << c10::toString(p.dtype) << " lora '" << p.lora << "' ring of " << p.sp
              << ": measured " << m.peak << ", model " << m.model.total_bytes() << " (ratio " << ratio << ") at "
              << describe(m.model) << "; without the block in flight: ratio " << dropped
              << "; the all-gather's model: ratio " << allgather);
    CHECK(std::abs(ratio - 1.0) <= 0.03);
    worst = std::max(worst, std::abs(ratio - 1.0));
    CHECK(std::abs(allgather - 1.0) > 0.03);  // the all-gather's model must miss on every point
    if (p.T == 2048 && p.dtype == at::kDouble) {
      CHECK(in_flight > 0);
      CHECK(std::abs(dropped - 1.0) > 0.03);
      ++controls;
    }
  }
  CHECK(controls == 2);
  WARN("ring: largest |measured / model - 1| over " << points.size() << " runs: " << worst);
}

TEST_CASE("the ring's per-rank memory models of standard BP and checkpointing (N = 2 and 3, fp64, and bf16 and LoRA at "
          "N = 3) match the measured peaks within 3 percent, and the all-gather's model misses",
          "[training][meter][memory-model][sequence-parallel][ring]") {
  struct Point {
    int sp;
    c10::ScalarType dtype;
    std::string lora;
  };
  // tiny-mha (n_kv = n_h): the K/V are a larger part of a layer, so the all-gather's whole-sequence K/V (and its K/V
  // gradients) miss by more than the tolerance at N = 2 too. T = 512: standard BP peaks at the loss with every layer's
  // graph, checkpointing at a layer's MLP backward in its re-forward graph (the ring's saved K/V and merged output).
  double worst = 0, closest_control = 1e9;
  int runs = 0;
  for (const std::string spec : {"standard", "checkpoint"})
    for (const auto& p : {Point{2, at::kDouble, ""}, Point{3, at::kDouble, ""}, Point{3, at::kBFloat16, ""},
                          Point{3, at::kDouble, "rank=8"}}) {
      const auto m = measure_rank(spec, p.lora, 512, 512, p.sp, 0, p.dtype, nullptr, {}, p.sp,
                                  sbp::SequenceScheme::ring, "tiny-mha");
      const double ratio = double(m.peak) / double(m.model.total_bytes());
      const double allgather = double(m.peak) / double(m.allgather_model.total_bytes());
      std::int64_t whole = 0;  // the ring holds no whole-sequence tensor
      for (const auto& t : m.model.terms)
        if (t.whole_sequence) whole += t.bytes;
      INFO(spec << " ring of " << p.sp << " " << c10::toString(p.dtype) << " lora=" << p.lora << ": measured " << m.peak
                << ", model " << m.model.total_bytes() << " (ratio " << ratio << ") at " << describe(m.model)
                << "; the all-gather's model: ratio " << allgather);
      CHECK(sbp::test::matches_model(m.peak, m.model));
      CHECK(whole == 0);
      CHECK(std::abs(allgather - 1.0) > 0.03);
      worst = std::max(worst, std::abs(ratio - 1.0));
      closest_control = std::min(closest_control, std::abs(allgather - 1.0));
      ++runs;
    }
  WARN("ring, standard BP and checkpointing: largest |measured / model - 1| over " << runs << " runs: " << worst
       << "; the all-gather's model's smallest miss: " << closest_control);
}

TEST_CASE("per-rank memory models of sequence-parallel StreamBP steps on packed rows (sequences across ranks, both "
          "schemes, N = 2 and 3, fp64 and bf16) match the measured peaks within 3 percent, and a model blind to the "
          "boundaries misses",
          "[training][meter][memory-model][sequence-parallel][packed]") {
  // Packed rows split over the group (docs/packing.md "Across a sequence-parallel group"): a rank's queries see only
  // their own sequences' keys, so the all-gather's chunk attention and the ring's key tiles hold no more keys than the
  // longest sequence. T = 1024 with small chunks and short documents, where those terms set the peak; the model of one
  // sequence of T per row (workload.packed dropped) is the negative control where they do (`attention_peak`).
  // Measured/analytic when written (torch 2.14.1, 2 threads, Intel AMX): 1.006, 1.004, 1.019; blind: 0.865, -, 0.939.
  struct Point {
    int sp;
    c10::ScalarType dtype;
    sbp::SequenceScheme scheme;
    bool attention_peak;
  };
  const std::vector<Point> points = {{2, at::kDouble, sbp::SequenceScheme::allgather, true},
                                     {3, at::kDouble, sbp::SequenceScheme::ring, false},
                                     {2, at::kBFloat16, sbp::SequenceScheme::ring, true}};
  double worst = 0;
  for (const auto& p : points) {
    const auto m = measure_rank("streambp:layer_chunk=16,head_chunk=64", "", 512, 1024, p.sp, 0, p.dtype, nullptr, {},
                                p.sp, p.scheme, "tiny", "uniform:min=16,max=120");
    REQUIRE(m.unpacked_model.total_bytes() > 0);
    const double ratio = double(m.peak) / double(m.model.total_bytes());
    INFO(c10::toString(p.dtype) << " SP " << p.sp << " "
                                << (p.scheme == sbp::SequenceScheme::ring ? "ring" : "all-gather") << ": measured "
                                << m.peak << ", model " << m.model.total_bytes() << " (ratio " << ratio << ") at "
                                << describe(m.model) << "; blind to the boundaries: ratio "
                                << double(m.peak) / double(m.unpacked_model.total_bytes()));
    CHECK(sbp::test::matches_model(m.peak, m.model));
    if (p.attention_peak) CHECK_FALSE(sbp::test::matches_model(m.peak, m.unpacked_model));
    worst = std::max(worst, std::abs(ratio - 1.0));
  }
  WARN("sequence parallelism on packed rows: largest |measured / model - 1| over " << points.size() << " runs: "
       << worst);
}
