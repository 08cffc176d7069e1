// The whole-RL-step oracle (docs/rl-steps.md): its stages against hand-computed values, the exact facts its step must
// satisfy on the tiny model in fp64, and one negative control per stage (tests/support/faulty_rl_step.h), each failing
// and naming the tensor where the planted bug shows first. TRL's own GRPOTrainer is the outside oracle
// (tests/oracle/rl_step_parity.py).
#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <string>

#include <ATen/ATen.h>

#include "core/methods/streaming.h"
#include "core/model/model.h"
#include "core/objectives/objective.h"
#include "core/objectives/rl_step.h"
#include "verify/conform_rl.h"
#include "verify/conformance.h"
#include "tests/support/faulty_rl_step.h"
#include "tests/support/test_support.h"
#include "verify/grad_compare.h"
#include "verify/rl_step_oracle.h"

using sbp::RlStepCase;

namespace {

constexpr double kRtol = 1e-12;

// Two prompts of uneven lengths, two completions each: one stops at an EOS and generates on (the tail is masked), one
// is truncated at max_completion_length, one is a lone EOS. Two reward functions, weighted. Two micro-batches in a
// shuffled order, one optimizer step (TRL's default steps_per_generation = gradient_accumulation_steps).
RlStepCase small_case(const std::string& loss_type) {
  RlStepCase c;
  c.prompts = {{5, 6, 7}, {8, 9, 10, 11, 12}};
  c.completions = {{7, 9, 1, 4, 4}, {11, 12, 13, 14, 15}, {1}, {21, 1}};
  c.rewards = at::tensor({1.0, 0.5, 0.0, 1.0, 0.25, 0.0, 2.0, 0.5}, at::kDouble).view({4, 2});
  c.micro_batches = {{0, 3}, {1, 2}};
  auto& s = c.settings;
  s.num_generations = 2;
  s.per_device_train_batch_size = 2;
  s.gradient_accumulation_steps = 2;
  s.max_completion_length = 5;
  s.loss_type = loss_type;
  s.reward_weights = {1.0, 0.5};
  s.beta = 0.04;
  s.use_bias_correction_kl = false;
  s.temperature = 0.9;
  return c;
}

sbp::Model tiny_model() { return sbp::Model(sbp::test::tiny_config(), at::kDouble, 7); }

sbp::RlStepResult run(const RlStepCase& c, const sbp::RlStepStages& stages = sbp::rl_step_stages()) {
  auto model = tiny_model();  // a fresh copy of the same weights per run: the oracle moves them by SGD
  return sbp::run_rl_step(model, c, stages);
}

std::string first_problem(const sbp::RlStepResult& expected, const sbp::RlStepResult& other) {
  const auto problems = sbp::rl_step_differences(expected, other, 1e-10);
  return problems.empty() ? "" : problems.front();
}

}  // namespace

TEST_CASE("rl step: a completion is kept up to its first EOS", "[rl-step]") {
  const auto a = sbp::keep_completion({7, 9, 1, 4, 1}, 1);
  CHECK(a.length == 3);
  CHECK_FALSE(a.truncated);
  const auto b = sbp::keep_completion({4, 4, 4}, 1);
  CHECK(b.length == 3);
  CHECK(b.truncated);
  CHECK(sbp::keep_completion({1, 5}, 1).length == 1);
  // Rows: prompt, kept completion, right pads; the completion mask on the kept completion only.
  auto c = small_case("dapo");
  const auto rows = sbp::rl_rows(c, at::zeros({4}, at::kDouble));
  CHECK(rows.input_ids.sizes() == at::IntArrayRef{4, 8});  // the longest: prompt 3 + the truncated completion 5
  CHECK(rows.attention_mask.sum(1).equal(at::tensor({6, 8, 6, 7}, at::kLong)));
  CHECK(rows.field("completion_mask").sum(1).equal(at::tensor({3, 5, 1, 2}, at::kLong)));
  CHECK(rows.input_ids[0][5].item<std::int64_t>() == 1);  // the EOS is scored
  CHECK(rows.input_ids[0][6].item<std::int64_t>() == 0);  // the tail after it is not in the row
  c.settings.mask_truncated_completions = true;
  CHECK(sbp::rl_rows(c, at::zeros({4}, at::kDouble)).field("completion_mask").sum(1).equal(at::tensor({3, 0, 1, 2}, at::kLong)));
}

TEST_CASE("rl step: advantages by group and by batch and unscaled", "[rl-step]") {
  // Combined rewards 1 + 0.5 * 0.5 = 1.25, 0.5, 0.25, 2.25: groups (1.25, 0.5) and (0.25, 2.25).
  const auto c = small_case("dapo");
  const auto r = at::tensor({1.25, 0.5, 0.25, 2.25}, at::kDouble);
  const auto centred = at::tensor({0.375, -0.375, -1.0, 1.0}, at::kDouble);
  const auto group_std = at::tensor({0.375 * std::sqrt(2.0), 0.375 * std::sqrt(2.0), std::sqrt(2.0), std::sqrt(2.0)}, at::kDouble);
  const auto batch_std = r.std(/*unbiased=*/true).item<double>();
  const auto w = c.settings.reward_weights;
  CHECK(at::allclose(sbp::rl_advantages(c.rewards, w, 2, "group"), centred / (group_std + 1e-4), kRtol, 0));
  CHECK(at::allclose(sbp::rl_advantages(c.rewards, w, 2, "batch"), centred / (batch_std + 1e-4), kRtol, 0));
  CHECK(at::allclose(sbp::rl_advantages(c.rewards, w, 2, "none"), centred, kRtol, 0));
  // TRL's aliases: true is group, false is none.
  const auto parsed = sbp::parse_rl_step_case(
      R"({"prompts": [[5]], "completions": [[1], [2, 1]], "rewards": [[1], [0]], "settings": {"scale_rewards": false}})", "t");
  CHECK(parsed.settings.scale_rewards == "none");
}

TEST_CASE("rl step: each loss_type's normaliser over the micro-steps", "[rl-step]") {
  // Micro-batches {0, 3}: 3 + 2 tokens, {1, 2}: 5 + 1; generation batch 11 tokens; GA = 2, steps_per_generation 2.
  for (const std::string loss : {"grpo", "bnpo", "dr_grpo", "dapo"}) {
    const auto c = small_case(loss);
    const auto steps = sbp::rl_micro_steps(c, sbp::rl_rows(c, at::zeros({4}, at::kDouble)));
    REQUIRE(steps.size() == 2);
    for (const auto& m : steps) {
      CHECK(m.optimizer_step == 0);
      CHECK(m.totals.rows == 4);  // grpo, dr_grpo: micro-batch mean over its 2 rows, / GA 2
    }
    if (loss == "bnpo") {
      CHECK(steps[0].totals.tokens == 10);
      CHECK(steps[1].totals.tokens == 12);
    }
    if (loss == "dapo") {
      CHECK(steps[0].totals.tokens == 11);
      CHECK(steps[0].scale == 1.0);  // 11 x GA 2 / steps_per_generation 2
    }
  }
  // num_iterations 2 and steps_per_generation 2 with GA 1: four optimizer steps; dapo's normaliser 11 x 1 / 2.
  auto c = small_case("dapo");
  c.settings.gradient_accumulation_steps = 1;
  c.settings.steps_per_generation = 2;
  c.settings.num_iterations = 2;
  const auto steps = sbp::rl_micro_steps(c, sbp::rl_rows(c, at::zeros({4}, at::kDouble)));
  REQUIRE(steps.size() == 4);
  CHECK(steps[3].optimizer_step == 3);
  CHECK(steps[3].iteration == 1);
  CHECK(steps[3].rows == std::vector<std::int64_t>{1, 2});
  CHECK(steps[0].scale == 2.0);
}

TEST_CASE("rl step: verl's declared loss_agg_mode and advantages' epsilon", "[rl-step]") {
  // verl 0.9.1's agg_loss normalises over the optimizer step's mini-batch: token-mean by its kept tokens (micro-batches
  // {0, 3} and {1, 2}: 5 + 6 = 11 in one step of GA 2; each its own in steps of GA 1), the seq-mean modes by its rows.
  auto c = small_case("dapo");
  c.settings.loss_agg_mode = "token-mean";
  auto steps = sbp::rl_micro_steps(c, sbp::rl_rows(c, at::zeros({4}, at::kDouble)));
  REQUIRE(steps.size() == 2);
  CHECK(steps[0].totals.tokens == 11);
  CHECK(steps[1].totals.tokens == 11);
  CHECK(steps[0].scale == 1.0);
  c.settings.gradient_accumulation_steps = 1;  // two optimizer steps of one micro-batch: not TRL's dapo (11 / 2 each)
  c.settings.steps_per_generation = 2;
  steps = sbp::rl_micro_steps(c, sbp::rl_rows(c, at::zeros({4}, at::kDouble)));
  CHECK(steps[0].totals.tokens == 5);
  CHECK(steps[1].totals.tokens == 6);
  c = small_case("grpo");
  c.settings.loss_agg_mode = "seq-mean-token-sum";
  steps = sbp::rl_micro_steps(c, sbp::rl_rows(c, at::zeros({4}, at::kDouble)));
  CHECK(steps[0].totals.rows == 4);
  CHECK(steps[0].scale == 5.0);  // dr_grpo's form times max_completion_length
  CHECK_THAT(sbp::rl_objective_spec(c.settings), Catch::Contains("loss_type=dr_grpo"));
  c.settings.loss_agg_mode = "seq-mean-token-mean";
  CHECK_THAT(sbp::rl_objective_spec(c.settings), Catch::Contains("loss_type=grpo"));
  // verl's GRPO estimator: std + 1e-6 (TRL: + 1e-4), read from the case.
  const auto parsed = sbp::parse_rl_step_case(
      R"({"prompts": [[5]], "completions": [[1], [2, 1]], "rewards": [[1], [0]],
          "settings": {"loss_agg_mode": "token-mean", "advantage_epsilon": 1e-6}})", "t");
  CHECK(parsed.settings.advantage_epsilon == 1e-6);
  CHECK(parsed.settings.loss_agg_mode == "token-mean");
  const auto centred = at::tensor({0.375, -0.375, -1.0, 1.0}, at::kDouble);
  const auto group_std = at::tensor({0.375 * std::sqrt(2.0), 0.375 * std::sqrt(2.0), std::sqrt(2.0), std::sqrt(2.0)}, at::kDouble);
  CHECK(at::allclose(sbp::rl_advantages(small_case("dapo").rewards, {1.0, 0.5}, 2, "group", 1e-6),
                     centred / (group_std + 1e-6), kRtol, 0));
  auto unknown = small_case("dapo");
  unknown.settings.loss_agg_mode = "token-sum";  // verl's, but no GRPO normaliser: refused, not guessed
  CHECK_THROWS_WITH(sbp::check_rl_step_case(unknown, sbp::test::tiny_config(), "case.json"),
                    Catch::Contains("loss_agg_mode must be"));
  // The whole step: the planted bug (verl's token-mean taken per micro-batch, 5 and 6 tokens instead of the step's 11)
  // fails at step 1 naming a gradient, and TRL's advantages (std + 1e-4) fail on advantages.
  auto verl_dapo = small_case("dapo");
  verl_dapo.settings.loss_agg_mode = "token-mean";
  verl_dapo.settings.advantage_epsilon = 1e-6;
  const auto expected = run(verl_dapo);
  CHECK(first_problem(expected, run(verl_dapo)).empty());
  CHECK_THAT(first_problem(expected, run(verl_dapo, sbp::test::per_micro_batch_normaliser_stages())),
             Catch::StartsWith("step 1 gradient"));
  CHECK_THAT(first_problem(expected, run(small_case("dapo"))), Catch::Contains("advantages"));  // TRL's 1e-4
  // conform's rl-verl set: every rl case, named <case>-verl, its loss_type's counterpart declared where verl has one.
  const auto verl = sbp::rl_verl_cases(sbp::test::tiny_config());
  std::map<std::string, std::string> modes;
  for (const auto& v : verl) {
    CHECK(v.rl_step->settings.advantage_epsilon == 1e-6);
    modes[v.name] = v.rl_step->settings.loss_agg_mode;
  }
  CHECK(verl.size() == 9);
  CHECK(modes.at("rl-dapo-group-ga2-verl") == "token-mean");
  CHECK(modes.at("rl-grpo-one-t1-verl") == "seq-mean-token-mean");
  CHECK(modes.at("rl-dr_grpo-masktrunc-ga2-verl") == "seq-mean-token-sum-norm");
  CHECK(modes.at("rl-bnpo-one-t09-verl") == "token-mean");     // one micro-batch: bnpo's count is the step's
  CHECK(modes.at("rl-bnpo-none-iter2-sequence-verl").empty());  // two micro-batches: verl has no bnpo
}

TEST_CASE("rl step: a bad case is refused naming what is wrong", "[rl-step]") {
  const auto config = sbp::test::tiny_config();
  auto c = small_case("dapo");
  c.completions[1].pop_back();  // no EOS and shorter than max_completion_length
  CHECK_THROWS_WITH(sbp::check_rl_step_case(c, config, "case.json"), Catch::Contains("completions[1] has no EOS"));
  c = small_case("dapo");
  c.settings.steps_per_generation = 2;
  c.settings.gradient_accumulation_steps = 4;
  CHECK_THROWS_WITH(sbp::check_rl_step_case(c, config, "case.json"), Catch::Contains("not a multiple of gradient_accumulation_steps"));
  c = small_case("dapo");
  c.settings.loss_type = "cispo";
  CHECK_THROWS_WITH(sbp::check_rl_step_case(c, config, "case.json"), Catch::Contains("settings.loss_type"));
  c = small_case("dapo");
  c.settings.use_bias_correction_kl = true;
  c.settings.importance_sampling_level = "sequence";
  CHECK_THROWS_WITH(sbp::check_rl_step_case(c, config, "case.json"), Catch::Contains("use_bias_correction_kl is true"));
  c = small_case("dapo");
  c.micro_batches = {{0, 1}, {1, 2}};
  CHECK_THROWS_WITH(sbp::check_rl_step_case(c, config, "case.json"), Catch::Contains("row 1 appears twice"));
  CHECK_THROWS_WITH(sbp::parse_rl_step_case(R"({"prompts": [[1]], "completion": []})", "case.json"),
                    Catch::Contains("case.json: unknown key 'completion'"));
  CHECK_THROWS_WITH(sbp::parse_rl_step_case(R"({"prompts": [[1]], "completions": [[1]], "rewards": [[1]], "settings": {"lr": 1}})",
                                            "case.json"), Catch::Contains("unknown setting 'lr'"));
}

TEST_CASE("rl step: log-probs are each sequence's own without padding", "[rl-step]") {
  const auto c = small_case("dapo");
  const auto r = run(c);
  auto model = tiny_model();
  for (std::int64_t row = 0; row < c.rows(); ++row) {  // each sequence alone, no pad anywhere
    auto prompt = c.prompts[row / 2];
    const auto kept = sbp::keep_completion(c.completions[row], 1).length;
    auto ids = prompt;
    ids.insert(ids.end(), c.completions[row].begin(), c.completions[row].begin() + kept);
    const auto alone = sbp::sequence_logps(model, at::tensor(ids, at::kLong).unsqueeze(0), 0.9)[0];
    const auto ours = r.token_logps[row].narrow(0, 0, kept);
    CHECK(at::allclose(ours, alone.narrow(0, std::int64_t(prompt.size()), kept).to(at::kDouble), kRtol, 0));
  }
}

TEST_CASE("rl step: micro-batches give one batch's gradient for grpo and dapo but not bnpo", "[rl-step]") {
  // grpo's micro-means of equal-sized micro-batches / GA and dapo's generation-batch normaliser make two
  // micro-batches the gradient of one of all four rows; bnpo's per-micro-batch token counts (5 and 6) do not.
  for (const std::string loss : {"grpo", "dapo", "bnpo"}) {
    const auto split = small_case(loss);
    auto whole = split;
    whole.micro_batches = {{0, 1, 2, 3}};
    whole.settings.per_device_train_batch_size = 4;
    whole.settings.gradient_accumulation_steps = 1;
    const auto a = run(split), b = run(whole);
    const auto problems = sbp::rl_step_differences(a, b, kRtol);
    INFO(loss << ": " << (problems.empty() ? "" : problems.front()));
    CHECK(problems.empty() == (loss != "bnpo"));
  }
}

TEST_CASE("rl step: a second iteration repeats the first gradient only without an update", "[rl-step]") {
  auto c = small_case("grpo");
  c.settings.gradient_accumulation_steps = 1;
  c.settings.steps_per_generation = 1;
  c.settings.per_device_train_batch_size = 4;
  c.settings.num_iterations = 2;
  c.micro_batches = {};
  const auto still = run(c);
  REQUIRE(still.gradients.size() == 2);
  const auto cmp = sbp::compare_gradients(still.gradients[0], still.gradients[1]);
  CHECK(cmp.passed(kRtol));
  c.settings.learning_rate = 0.5;
  const auto moved = run(c);
  CHECK(sbp::compare_gradients(moved.gradients[0], still.gradients[0]).passed(kRtol));
  CHECK_FALSE(sbp::compare_gradients(moved.gradients[0], moved.gradients[1]).passed(1e-6));
}

TEST_CASE("rl step: each planted bug fails naming a tensor", "[rl-step]") {
  using namespace sbp::test;
  const auto dapo = small_case("dapo");
  const auto expected = run(dapo);
  CHECK(sbp::rl_step_differences(expected, run(dapo), 0).empty());  // the oracle is deterministic
  CHECK_THAT(first_problem(expected, run(dapo, pads_attended_stages())), Catch::StartsWith("token_logps"));
  CHECK_THAT(first_problem(expected, run(dapo, eos_mask_off_by_one_stages())), Catch::StartsWith("completion_mask"));
  CHECK_THAT(first_problem(expected, run(dapo, batch_normalised_advantages_stages())), Catch::StartsWith("advantages"));
  CHECK_THAT(first_problem(expected, run(dapo, per_micro_batch_normaliser_stages())), Catch::StartsWith("step 1 gradient"));
  // old_logps from the wrong pass: the same first optimizer step, a different second one (after the SGD update).
  auto twice = dapo;
  twice.settings.gradient_accumulation_steps = 1;
  twice.settings.steps_per_generation = 2;
  twice.settings.learning_rate = 0.5;
  const auto expected_twice = run(twice);
  REQUIRE(expected_twice.gradients.size() == 2);
  CHECK_THAT(first_problem(expected_twice, run(twice, old_logps_from_current_pass_stages())),
             Catch::StartsWith("step 2 gradient"));
}

TEST_CASE("rl step: StreamBP gives the oracle's step", "[rl-step]") {
  // The whole step through StreamBP (head and layers in chunks that cut the rows, sequence importance's statistics
  // pass included) equals standard BP's at the fp64 gate, over two optimizer steps and an SGD update.
  auto c = small_case("grpo");
  c.settings.importance_sampling_level = "sequence";
  c.settings.gradient_accumulation_steps = 1;
  c.settings.steps_per_generation = 2;
  c.settings.learning_rate = 0.02;
  const auto standard = run(c);
  auto model = tiny_model();
  const auto streamed = sbp::run_rl_step(model, c, sbp::rl_step_stages(), "streambp:layer_chunk=3,head_chunk=2");
  const auto problems = sbp::rl_step_differences(standard, streamed, sbp::test::kFp64Rtol);
  INFO((problems.empty() ? "" : problems.front()));
  CHECK(problems.empty());
}

TEST_CASE("rl step: TRL's bias-corrected KL changes the step only after an update", "[rl-step]") {
  // use_bias_correction_kl (TRL 1.16.0's default) multiplies the k3 KL by the importance ratio. Before any update the
  // policy is the reference (KL = 0 and dKL = 0), so the first optimizer step is the same with it or without; after
  // one SGD step it is not.
  auto c = small_case("dapo");
  c.settings.gradient_accumulation_steps = 1;
  c.settings.steps_per_generation = 2;
  c.settings.learning_rate = 0.02;
  const auto plain = run(c);
  c.settings.use_bias_correction_kl = true;
  CHECK(sbp::rl_objective_spec(c.settings).find(",kl=k3_ratio") != std::string::npos);
  const auto corrected = run(c);
  CHECK(sbp::compare_gradients(plain.gradients[0], corrected.gradients[0]).passed(kRtol));
  CHECK_FALSE(sbp::compare_gradients(plain.gradients[1], corrected.gradients[1]).passed(1e-8));
  CHECK_THROWS_WITH(sbp::make_objective("grpo:beta=0.1,kl=k3_ratio,importance=sequence"),
                    Catch::Contains("kl=k3_ratio is defined here for importance=token only"));
  const auto grpo = sbp::make_objective("grpo:beta=0.1,kl=k3_ratio");
  CHECK(sbp::make_objective(grpo->spec())->spec() == grpo->spec());
}

// conform's rl set (issue #60): the judge of an rl_step case (verify/conformance.h) on the oracle's own step and on
// each known bug's (tests/support/faulty_rl_step.h), as an implementation would return them: every bug is named at
// the tensor where it shows first, and a missing optimizer step is a protocol problem.
TEST_CASE("rl step: conform's rl cases pass their own oracle and name each planted bug's tensor",
          "[rl-step][conform]") {
  std::map<std::string, sbp::ConformCase> cases;
  for (auto& c : sbp::conform_cases("rl")) cases.emplace(c.name, c);
  REQUIRE(cases.size() == 9);
  const auto step = [](const sbp::ConformCase& c, const sbp::RlStepStages& stages) {
    sbp::Model model(c.config, at::kDouble, c.batch.seed);
    return sbp::run_rl_step(model, *c.rl_step, stages);
  };
  const auto returned = [](const sbp::RlStepResult& r) {  // as the protocol has them: every tensor float64
    auto tensors = sbp::rl_step_tensors(r);
    for (auto& t : tensors) t.tensor = t.tensor.to(at::kDouble);
    return tensors;
  };
  for (const auto& [name, c] : cases) {
    INFO(name);
    const auto oracle = step(c, sbp::rl_step_stages());
    const auto verdict = sbp::judge_rl_step(*c.rl_step, oracle, returned(oracle), 1e-10);
    CHECK(verdict.passed);
    CHECK(verdict.problem == "");
  }
  struct Planted {
    std::string bug, case_name, tensor_prefix;
    sbp::RlStepStages stages;
  };
  const std::vector<Planted> planted = {
      {"pads attended", "rl-dapo-group-ga2", "token_logps", sbp::test::pads_attended_stages()},
      {"EOS mask off by one", "rl-dapo-group-ga2", "completion_mask", sbp::test::eos_mask_off_by_one_stages()},
      {"advantages over the batch", "rl-dapo-group-ga2", "advantages", sbp::test::batch_normalised_advantages_stages()},
      {"dapo's normaliser per micro-batch", "rl-dapo-group-ga2", "step1/",
       sbp::test::per_micro_batch_normaliser_stages()},
      {"old_logps from the current pass", "rl-grpo-batch-spg2", "step2/",
       sbp::test::old_logps_from_current_pass_stages()},
  };
  for (const auto& p : planted) {
    INFO(p.bug);
    const auto& c = cases.at(p.case_name);
    const auto oracle = step(c, sbp::rl_step_stages());
    const auto verdict = sbp::judge_rl_step(*c.rl_step, oracle, returned(step(c, p.stages)), 1e-10);
    CHECK_FALSE(verdict.passed);
    CHECK(verdict.problem.empty());
    CHECK(verdict.worst_tensor.rfind(p.tensor_prefix, 0) == 0);
    CHECK(verdict.worst > 1e-6);
  }
  // Only the gradients: the stages are optional; a missing optimizer step is named.
  const auto& c = cases.at("rl-grpo-batch-spg2");
  const auto oracle = step(c, sbp::rl_step_stages());
  sbp::TensorList first_step_only;
  for (const auto& t : returned(oracle))
    if (t.name.rfind("step1/", 0) == 0) first_step_only.push_back(t);
  const auto missing = sbp::judge_rl_step(*c.rl_step, oracle, first_step_only, 1e-10);
  CHECK_FALSE(missing.passed);
  CHECK_THAT(missing.problem, Catch::Contains("tensor 'step2/model.norm.weight' missing"));
}
