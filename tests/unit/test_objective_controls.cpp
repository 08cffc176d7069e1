// Negative controls of the objectives' gates (ARCHITECTURE.md §8): each known way of getting GRPO or DPO wrong — the public
// StreamBP code's bugs among them — makes the fp64 exactness gate fail, and the same setup without
// the fault passes it.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "core/objectives/batch.h"
#include "core/objectives/dpo.h"
#include "core/objectives/grpo.h"
#include "core/model/model.h"
#include "core/io/spec.h"
#include "core/methods/streaming.h"
#include "tests/support/faulty_objectives.h"
#include "tests/support/test_support.h"
#include "verify/grad_compare.h"

using sbp::Batch;
using sbp::test::run_step;

namespace {

using sbp::test::kFp64Rtol;
const std::string kStream = "streambp:layer_chunk=5,head_chunk=6";  // T = 24: several head and layer chunks

sbp::ModelConfig untied_tiny() {
  auto config = sbp::test::tiny_config();
  config.tie_word_embeddings = false;
  return config;
}

// Standard BP with the correct objective against StreamBP with `faulty` (same spec, a faulty subclass of
// tests/support/faulty_objectives.h).
sbp::GradComparison streamed_against_standard(sbp::Objective& correct, sbp::Objective& faulty) {
  const auto config = untied_tiny();
  sbp::Model model(config, at::kDouble, 61);
  const Batch batch = sbp::test::objective_batch(model, correct, {4, 24, 0.2, 0.0, 62, 2});
  const auto standard = run_step(model, "standard", correct, batch);
  return sbp::compare_gradients(standard.gradients, run_step(model, kStream, faulty, batch).gradients);
}

void require_gate_fails(const sbp::GradComparison& cmp) {
  INFO("largest normwise relative error " << cmp.max_normwise_rel() << " in " << (cmp.worst() ? cmp.worst()->name : "-"));
  CHECK(cmp.problems.empty());
  CHECK_FALSE(cmp.passed(kFp64Rtol));
}

sbp::Spec spec_of(const std::string& text) { return sbp::parse_spec(text, "objective"); }

}  // namespace

TEST_CASE("the exactness gate fails when DPO skips the first completion token", "[negative-control][objective]") {
  sbp::DpoObjective correct(spec_of("dpo"));
  sbp::test::FirstTokenSkippingDpo faulty(spec_of("dpo"));
  require_gate_fails(streamed_against_standard(correct, faulty));
}

TEST_CASE("the exactness gate fails when DPO's coefficients come from per-chunk partial sums",
          "[negative-control][objective]") {
  sbp::DpoObjective correct(spec_of("dpo:beta=0.5"));
  sbp::test::PartialStatisticsDpo faulty(spec_of("dpo:beta=0.5"));
  require_gate_fails(streamed_against_standard(correct, faulty));
}

TEST_CASE("the exactness gate fails when GRPO is normalised per chunk instead of over the batch",
          "[negative-control][objective]") {
  for (const std::string text : {"grpo:loss_type=bnpo,beta=0.04", "grpo:loss_type=grpo"}) {
    INFO(text);
    sbp::GrpoObjective correct(spec_of(text));
    sbp::test::PerChunkNormalisedGrpo faulty(spec_of(text));
    require_gate_fails(streamed_against_standard(correct, faulty));
  }
}

TEST_CASE("the same objectives without faults pass the gate", "[negative-control][objective]") {
  for (const std::string text : {"dpo", "dpo:beta=0.5", "grpo:loss_type=bnpo,beta=0.04", "grpo:loss_type=grpo"}) {
    INFO(text);
    auto correct = sbp::make_objective(text), twin = sbp::make_objective(text);
    CHECK(streamed_against_standard(*correct, *twin).passed(kFp64Rtol));
  }
}

namespace {

// The reference policy's log-probs taken the wrong way (the public code's DPO): the reference's final norm and LM
// head applied to the *policy's* hidden states. [B, T] in sequence_logps' layout.
at::Tensor reference_logps_on_policy_states(const sbp::Model& policy, const sbp::Model& reference, const at::Tensor& ids) {
  at::NoGradGuard no_grad;
  auto h = policy.embed(ids);
  for (int l = 0; l < policy.config().num_hidden_layers; ++l) h = policy.layer_forward(l, h);
  const auto logp = at::log_softmax(reference.logits(reference.final_norm(h)), -1);  // [B, T, V]
  const auto picked = logp.slice(1, 0, -1).gather(-1, ids.slice(1, 1).unsqueeze(-1)).squeeze(-1);
  return at::cat({at::zeros({ids.size(0), 1}, picked.options()), picked}, 1);
}

// The reference's own log-probs by its plain full-sequence forward: the oracle for sequence_logps.
at::Tensor reference_logps_full_forward(const sbp::Model& reference, const at::Tensor& ids) {
  return reference_logps_on_policy_states(reference, reference, ids);
}

}  // namespace

TEST_CASE("reference log-probs come from the reference's own hidden states, and the policy's states fail the gate",
          "[negative-control][objective][reference]") {
  const auto config = untied_tiny();
  sbp::Model policy(config, at::kDouble, 71), reference(config, at::kDouble, 72);  // two different weight sets
  sbp::DpoObjective dpo(spec_of("dpo"));
  const Batch tokens = dpo.random_batch(config, {4, 24, 0.2, 0.0, 73});
  const auto oracle = reference_logps_full_forward(reference, tokens.input_ids);

  // Our chunked reference pass equals the reference's own full forward...
  const auto ours = sbp::sequence_logps(reference, tokens.input_ids, 1.0, /*layer_chunk=*/5, /*head_chunk=*/7);
  CHECK((ours - oracle).abs().max().item<double>() <= 1e-12 * oracle.abs().max().item<double>());
  // ...and the public code's shortcut does not.
  const auto shortcut = reference_logps_on_policy_states(policy, reference, tokens.input_ids);
  CHECK((shortcut - oracle).abs().max().item<double>() > 1e-3 * oracle.abs().max().item<double>());

  // End to end: DPO gradients with the shortcut's reference fail the gate against those with the true reference.
  const auto right = run_step(policy, kStream, dpo, dpo.with_reference(tokens, oracle));
  const auto wrong = run_step(policy, kStream, dpo, dpo.with_reference(tokens, shortcut));
  require_gate_fails(sbp::compare_gradients(right.gradients, wrong.gradients));
}
