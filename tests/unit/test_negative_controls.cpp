// Every gate has a negative control (ARCHITECTURE.md §8): the fp64 exactness check must fail on each classic way of getting
// a streamed backward wrong, and the gradient checker must reject hand-made bad gradient lists. A gate that never
// fails proves nothing.
#include <catch2/catch.hpp>

#include <filesystem>
#include <limits>

#include <unistd.h>

#include <ATen/ATen.h>

#include "core/objectives/batch.h"
#include "core/model/model.h"
#include "core/objectives/sft.h"
#include "core/methods/streambp.h"
#include "baselines/methods.h"
#include "baselines/mst.h"
#include "experiments/commands.h"
#include "tests/support/faulty_methods.h"
#include "tests/support/test_support.h"
#include "verify/grad_compare.h"

using sbp::TensorList;
using sbp::test::MsTFault;
using sbp::test::StreamBPFault;
using sbp::test::run_step;

namespace {

using sbp::test::kFp64Rtol;  // the exactness gate

// Standard BP against StreamBP with `fault` (tests/support/faulty_methods.h), in fp64 on the tiny preset (untied, so that
// the lm_head and the embedding gradients are checked separately). No padding: padded tail positions carry no loss,
// and a fault that only touches them (drop_tail) would be invisible.
sbp::GradComparison faulty_streambp_error(StreamBPFault fault, std::int64_t seq_len, std::int64_t layer_chunk) {
  sbp::ModelConfig config = sbp::test::tiny_config();
  config.tie_word_embeddings = false;
  sbp::Model model(config, at::kDouble, 41);
  const sbp::Batch batch = sbp::random_sft_batch(config, {2, seq_len, 0.0, 0.0, 42});
  const auto standard = run_step(model, "standard", batch);

  const auto stream = sbp::test::make_streambp(fault, {layer_chunk, /*head_chunk=*/5});
  sbp::SftObjective objective;
  stream->step(model, objective, batch);
  return sbp::compare_gradients(standard.gradients, model.gradients());
}

void require_method_gate_fails(const sbp::GradComparison& cmp) {
  const auto* worst = cmp.worst();
  INFO("largest normwise relative error " << cmp.max_normwise_rel() << " in " << (worst ? worst->name : "-"));
  CHECK(cmp.problems.empty());  // the gradients are all there; only their values are wrong
  CHECK_FALSE(cmp.passed(kFp64Rtol));
}

TensorList clone_all(const TensorList& tensors) {
  TensorList out;
  for (const auto& t : tensors) out.push_back({t.name, t.tensor.clone()});
  return out;
}

}  // namespace

TEST_CASE("the exactness gate fails when chunks use top-left causal alignment", "[negative-control]") {
  // Needs a chunk with s > 0: T = 16 in chunks of 4.
  require_method_gate_fails(faulty_streambp_error(StreamBPFault::top_left_causal, 16, 4));
}

TEST_CASE("the exactness gate fails when the dK/dV path is dropped", "[negative-control]") {
  require_method_gate_fails(faulty_streambp_error(StreamBPFault::drop_kv_path, 16, 4));
}

TEST_CASE("the exactness gate fails on a doubled head gradient", "[negative-control]") {
  require_method_gate_fails(faulty_streambp_error(StreamBPFault::double_head_grad, 16, 4));
}

TEST_CASE("the exactness gate fails when the tail tokens are dropped", "[negative-control]") {
  // Needs T mod c >= 2: T = 14 in chunks of 4 leaves two tokens out. A single dropped token would go unnoticed by
  // any gate: the last position predicts nothing (its shifted label is -100) and no earlier query attends to it,
  // so its exact gradient is zero in every layer (measured: 6e-16 with T = 13).
  require_method_gate_fails(faulty_streambp_error(StreamBPFault::drop_tail, 14, 4));
}

namespace {

// verify --gate's rule on one fault: StreamBP (with `fault`) and standard BP in `dtype`, both against the fp64 oracle
// on the same weights (tiny, untied, no padding, chunks of 4 as above).
// mixed: bf16 compute with fp32 masters and gradients (--grad-dtype fp32).
sbp::RuleVerdict low_precision_verdict(StreamBPFault fault, c10::ScalarType dtype, std::int64_t seq_len,
                                       bool mixed = false) {
  sbp::ModelConfig config = sbp::test::tiny_config();
  config.tie_word_embeddings = false;
  sbp::Model model(config, dtype, 43);
  sbp::Model oracle_model(config, at::kDouble, model.parameters(), "low-precision weights");
  if (mixed) model.set_grad_dtype(at::kFloat);
  const sbp::Batch batch = sbp::random_sft_batch(config, {2, seq_len, 0.0, 0.0, 44});
  const auto oracle = run_step(oracle_model, "standard", batch);
  const auto standard = run_step(model, "standard", batch);
  const auto stream = sbp::test::make_streambp(fault, {/*layer_chunk=*/4, /*head_chunk=*/5});
  sbp::SftObjective objective;
  stream->step(model, objective, batch);
  return sbp::low_precision_rule(sbp::compare_gradients(oracle.gradients, standard.gradients),
                                 sbp::compare_gradients(oracle.gradients, model.gradients()), dtype);
}

}  // namespace

TEST_CASE("verify --gate's low-precision rule fails on each of the four faults, in fp32, bf16 and bf16-mixed",
          "[negative-control][low-precision]") {
  // The rule tolerates allowance(n) x standard BP's error in the same dtype: a fault must stand out of that by a wide
  // margin (issue #28: at least 5x the allowance), or the next CPU's rounding could hide it. The unfaulted twin passes
  // on the same model and batch.
  struct Fault {
    const char* name;
    StreamBPFault fault;
    std::int64_t seq_len;
  };
  for (const auto& [dtype, mixed] : {std::pair{at::kFloat, false}, {at::kBFloat16, false}, {at::kBFloat16, true}}) {
    for (const auto& f : {Fault{"top-left causal", StreamBPFault::top_left_causal, 16},
                          Fault{"dropped dK/dV path", StreamBPFault::drop_kv_path, 16},
                          Fault{"doubled head gradient", StreamBPFault::double_head_grad, 16},
                          Fault{"dropped tail", StreamBPFault::drop_tail, 14}}) {
      const auto verdict = low_precision_verdict(f.fault, dtype, f.seq_len, mixed);
      INFO(c10::toString(dtype) << (mixed ? "-mixed " : " ") << f.name << ": " << verdict.worst_ratio << "x the allowance on " << verdict.worst_tensor);
      CHECK(verdict.worst_ratio >= 5);
    }
    for (const std::int64_t T : {14, 16}) {
      const auto verdict = low_precision_verdict(StreamBPFault::none, dtype, T, mixed);
      INFO(c10::toString(dtype) << (mixed ? "-mixed" : "") << " no fault, T = " << T << ": " << verdict.worst_ratio << "x the allowance on " << verdict.worst_tensor);
      CHECK(verdict.passed());
    }
  }
}

TEST_CASE("the exactness gate passes the same StreamBP without faults", "[negative-control]") {
  // The positive twin of the controls above: same model, batch and chunks, so their failures are the faults' doing.
  for (const std::int64_t T : {14, 16}) {
    INFO("T=" << T);
    CHECK(faulty_streambp_error(StreamBPFault::none, T, 4).passed(kFp64Rtol));
  }
}

namespace {

// Standard BP against MsT with `fault` (tests/support/faulty_methods.h), fp64, untied tiny preset, no padding (every target
// carries loss).
sbp::GradComparison faulty_mst_error(MsTFault fault, std::int64_t seq_len, std::int64_t mini_seq) {
  sbp::ModelConfig config = sbp::test::tiny_config();
  config.tie_word_embeddings = false;
  sbp::Model model(config, at::kDouble, 43);
  const sbp::Batch batch = sbp::random_sft_batch(config, {2, seq_len, 0.0, 0.0, 44});
  const auto standard = run_step(model, "standard", batch);
  const auto mst = sbp::test::make_mst(fault, {mini_seq});
  sbp::SftObjective objective;
  mst->step(model, objective, batch);
  return sbp::compare_gradients(standard.gradients, model.gradients());
}

}  // namespace

TEST_CASE("the exactness gate fails on MsT's doubled LM-head gradient (the public code's bug A)", "[negative-control][mst]") {
  require_method_gate_fails(faulty_mst_error(MsTFault::double_head_grad, 16, 4));
}

TEST_CASE("the exactness gate fails when MsT drops the last (T-1) mod M targets (the public code's bug B)",
          "[negative-control][mst]") {
  // T = 16, M = 4: slices of floor(15/4) = 3 positions cover 12 targets; 3 carry loss but get no gradient.
  require_method_gate_fails(faulty_mst_error(MsTFault::drop_tail, 16, 4));
}

TEST_CASE("the same MsT without faults passes the gate", "[negative-control][mst]") {
  CHECK(faulty_mst_error(MsTFault::none, 16, 4).passed(kFp64Rtol));
}

namespace {

TensorList tiny_gradients() {
  sbp::ModelConfig config = sbp::test::tiny_config();
  config.tie_word_embeddings = false;
  sbp::Model model(config, at::kDouble, 51);
  return run_step(model, "standard", sbp::random_sft_batch(config, {1, 12, 0.0, 0.0, 52})).gradients;
}

}  // namespace

TEST_CASE("the checker rejects a doubled head gradient", "[negative-control][checker]") {
  const TensorList ref = tiny_gradients();
  TensorList doubled = clone_all(ref);
  for (auto& t : doubled)
    if (t.name == "lm_head.weight") t.tensor.mul_(2);
  const auto cmp = sbp::compare_gradients(ref, doubled);
  CHECK(cmp.problems.empty());
  CHECK_FALSE(cmp.passed(kFp64Rtol));
  REQUIRE(cmp.worst() != nullptr);
  CHECK(cmp.worst()->name == "lm_head.weight");
  // max|g - 2g| / max|g| is exactly 1: doubling in floating point is exact.
  CHECK(cmp.worst()->normwise_rel == 1.0);
  CHECK(sbp::compare_gradients(ref, clone_all(ref)).max_normwise_rel() == 0.0);
}

TEST_CASE("the checker rejects a missing tensor or a shape mismatch at any tolerance", "[negative-control][checker]") {
  const TensorList ref = tiny_gradients();
  const double any_tolerance = std::numeric_limits<double>::infinity();

  TensorList missing = clone_all(ref);
  missing.erase(missing.begin() + 3);
  const auto missing_cmp = sbp::compare_gradients(ref, missing);
  REQUIRE(missing_cmp.problems.size() == 1);
  CHECK_THAT(missing_cmp.problems[0], Catch::Contains(ref[3].name) && Catch::Contains("missing"));
  CHECK_FALSE(missing_cmp.passed(any_tolerance));

  // A tensor the reference lacks is as wrong as one it has and the other lacks.
  const auto extra_cmp = sbp::compare_gradients(missing, ref);
  REQUIRE(extra_cmp.problems.size() == 1);
  CHECK_THAT(extra_cmp.problems[0], Catch::Contains(ref[3].name));
  CHECK_FALSE(extra_cmp.passed(any_tolerance));

  TensorList reshaped = clone_all(ref);
  reshaped[1].tensor = reshaped[1].tensor.reshape({1, -1});
  const auto shape_cmp = sbp::compare_gradients(ref, reshaped);
  REQUIRE(shape_cmp.problems.size() == 1);
  CHECK_THAT(shape_cmp.problems[0], Catch::Contains(ref[1].name) && Catch::Contains("shape"));
  CHECK_FALSE(shape_cmp.passed(any_tolerance));
}

TEST_CASE("the checker rejects a NaN gradient", "[negative-control][checker]") {
  // NaN compares false with everything: a gate written as `error > rtol` would let it through.
  const TensorList ref = tiny_gradients();
  TensorList poisoned = clone_all(ref);
  poisoned[0].tensor.view({-1})[0] = std::numeric_limits<double>::quiet_NaN();
  CHECK_FALSE(sbp::compare_gradients(ref, poisoned).passed(kFp64Rtol));
}

TEST_CASE("the checker passes an exact method on tensors whose true gradient is zero, and fails a real error there",
          "[negative-control][checker]") {
  // B = 1, T = 2: the only loss token attends to one key, so every q/k-path gradient is exactly zero in exact
  // arithmetic and both methods return rounding noise there. Judged against its own scale that noise gave a
  // normwise error of 2 and a FAILED verdict for an exact method; judged against the model-wide floor it passes.
  sbp::ModelConfig config = sbp::test::tiny_config();
  sbp::Model model(config, at::kDouble, 53);
  const auto batch = sbp::random_sft_batch(config, {1, 2, 0.0, 0.0, 54});
  const auto standard = run_step(model, "standard", batch);
  const auto stream = run_step(model, "streambp:layer_chunk=1,head_chunk=1", batch);
  const auto cmp = sbp::compare_gradients(standard.gradients, stream.gradients);
  int degenerate = 0;
  for (const auto& t : cmp.tensors) degenerate += t.degenerate;
  INFO("largest normwise relative error " << cmp.max_normwise_rel() << " in " << cmp.worst()->name);
  CHECK(degenerate > 0);
  CHECK(cmp.passed(kFp64Rtol));

  // A perturbation of 1e-3 of the global maximum on a zero-gradient tensor is a real error: it fails.
  TensorList perturbed = clone_all(stream.gradients);
  for (auto& t : perturbed)
    if (t.name == "model.layers.0.self_attn.q_proj.weight") t.tensor.view({-1})[0] += 1e-3 * cmp.global_max_abs;
  const auto bad = sbp::compare_gradients(standard.gradients, perturbed);
  REQUIRE(bad.worst() != nullptr);
  CHECK(bad.worst()->name == "model.layers.0.self_attn.q_proj.weight");
  CHECK(bad.worst()->degenerate);
  CHECK_FALSE(bad.passed(kFp64Rtol));
}


TEST_CASE("verify --gate as a command exits 1 on a faulty method and 0 on its correct twin", "[negative-control][verify]") {
  // The command end to end (verify_command: oracle, runs, rule, exit code), with the faulty StreamBP registered as a
  // method the way a user registers a new one.
  // Its spec names it, so that a command rebuilding methods from their specs builds it again.
  struct Registered : sbp::test::DoubledHeadGradStreamBP {
    using sbp::test::DoubledHeadGradStreamBP::DoubledHeadGradStreamBP;
    std::string spec() const override { return "faulty-doubled-head"; }
  };
  sbp::register_method("faulty-doubled-head", [](const sbp::Spec& spec) -> std::unique_ptr<sbp::BackpropMethod> {
    spec.check_keys({});
    return std::make_unique<Registered>(sbp::StreamBP::Options{8, 8});
  });
  const auto out = std::filesystem::temp_directory_path() / ("streambp-verify-gate-" + std::to_string(::getpid()));
  sbp::VerifyArgs args;
  args.setup.source = args.setup.source.or_preset("tiny");
  args.measure.seq_lens = {16};
  args.gate = true;
  args.output.out_dir = out.string();
  args.methods = {"faulty-doubled-head"};
  CHECK(sbp::verify_command(args, "test") == 1);
  args.methods = {"streambp:layer_chunk=8,head_chunk=8"};
  CHECK(sbp::verify_command(args, "test") == 0);
  std::filesystem::remove_all(out);
}
