// Every objective's streamed head is its whole-sequence gradient: the in-place chunk gradient (what StreamBP's head
// uses) equals autograd's gradient of the chunk term, and the chunk gradients of any partition of [0, T) — after the
// statistics pass where the objective needs one — put together are dLoss/dlogits of the whole sequence, with the
// chunk terms adding up to the loss.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include "core/objectives/batch.h"
#include "core/objectives/catalogue.h"
#include "core/objectives/objective.h"
#include "tests/support/test_support.h"

using namespace sbp;
using sbp::test::tiny_config;

namespace {

constexpr std::int64_t kB = 4, kT = 23;

// One objective's problem: random fp64 logits [B, T, V] as the "policy", and a batch of the objective's format whose
// old/ref log-probs are perturbations of that policy's (so that clipping and non-zero DPO margins occur), the
// objective prepared on it.
struct Problem {
  std::unique_ptr<Objective> formula;
  Batch batch;
  at::Tensor logits;
  std::optional<PreparedObjective> objective;
};

Problem make_problem(const std::string& spec, bool keep_old_logps = true) {
  const auto config = tiny_config();
  Problem p{make_objective(spec), {}, {}, {}};
  p.batch = p.formula->random_batch(config, {kB, kT, 0.3, 0.25, 11, 2});
  at::manual_seed(12);
  p.logits = at::randn({kB, kT, config.vocab_size}, at::TensorOptions().dtype(at::kDouble)) * 3.0;
  // The policy's log-prob of token t (column t), as sequence_logps lays it out.
  const auto logp = at::log_softmax(p.logits / p.formula->temperature(), -1)
                        .slice(1, 0, kT - 1)
                        .gather(-1, p.batch.input_ids.slice(1, 1).unsqueeze(-1))
                        .squeeze(-1);
  const auto token_logps = at::cat({at::zeros({kB, 1}, logp.options()), logp}, 1);
  if (p.formula->wants_policy_logps()) p.formula->add_synthetic_logps(p.batch, token_logps, 13, false);
  if (!keep_old_logps) p.batch.fields.erase("old_logps");
  p.objective = p.formula->prepare(p.batch, config, std::nullopt, spec);
  return p;
}

// Every objective of the catalogue at its test specs (a new objective is in these tests by its entry), and the option
// branches of the built-in ones beyond those.
const std::vector<std::string> kSpecs = [] {
  std::vector<std::string> specs;
  for (const auto& e : objective_catalogue()) specs.insert(specs.end(), e.test_specs.begin(), e.test_specs.end());
  for (const char* spec : {"grpo",  // TRL's current defaults: beta 0, dapo, token importance
                           "grpo:beta=0.04,loss_type=bnpo,temperature=0.9",
                           "grpo:loss_type=grpo,epsilon_high=0.28,beta=0.1",
                           "grpo:loss_type=dr_grpo,max_completion_length=30,importance=sequence,beta=0.2",
                           "grpo:importance=sequence,temperature=0.7,loss_type=grpo", "dpo",
                           "dpo:beta=0.5,label_smoothing=0.2"})
    specs.push_back(spec);
  return specs;
}();

void run_statistics_pass(Problem& p, std::int64_t chunk) {
  if (!p.objective->needs_statistics()) return;
  StatisticsPass statistics(*p.objective);
  for (std::int64_t s = 0; s < kT; s += chunk) {
    auto logits = p.logits.slice(1, s, std::min(kT, s + chunk)).clone();  // the pass may overwrite its logits
    statistics.add(logits, s);
  }
  p.objective = statistics.finish();
}

}  // namespace

TEST_CASE("each objective's in-place chunk gradient equals autograd's gradient of its chunk term", "[objective]") {
  for (const auto& spec : kSpecs) {
    auto p = make_problem(spec);
    run_statistics_pass(p, 9);
    for (const std::int64_t start : {0, 9, 18}) {
      const auto c = std::min<std::int64_t>(9, kT - start);
      auto fused = p.logits.slice(1, start, start + c).clone();
      auto by_autograd = fused.clone();
      const double fused_loss = p.objective->chunk_loss_and_grad(fused, start);
      const double autograd_loss = p.objective->chunk_loss_and_grad_by_autograd(by_autograd, start);
      INFO(spec << ", chunk [" << start << ", " << start + c << ")");
      CHECK(std::abs(fused_loss - autograd_loss) <= 1e-12 * std::max(1.0, std::abs(autograd_loss)));
      const double scale = by_autograd.abs().max().item<double>();
      REQUIRE(scale > 0);
      CHECK((fused - by_autograd).abs().max().item<double>() <= 1e-12 * scale);
    }
  }
}

TEST_CASE("streamed chunk terms of every objective add up to the loss and their gradients to dLoss/dlogits",
          "[objective]") {
  for (const auto& spec : kSpecs)
    for (const bool keep_old : {true, false}) {
      if (!keep_old && spec.rfind("grpo", 0) != 0) continue;  // only GRPO reads old_logps
      for (const std::int64_t chunk : {std::int64_t(1), std::int64_t(5), std::int64_t(9), kT}) {
        INFO(spec << (keep_old ? "" : " without old_logps") << ", head chunk " << chunk);
        auto whole = make_problem(spec, keep_old);
        auto leaf = whole.logits.clone().requires_grad_(true);
        const auto full_loss = whole.objective->chunk_loss(leaf, 0);
        full_loss.backward();

        auto streamed = make_problem(spec, keep_old);
        run_statistics_pass(streamed, chunk);
        auto grad = streamed.logits.clone();
        double loss = 0;
        for (std::int64_t s = 0; s < kT; s += chunk) {
          auto part = grad.slice(1, s, std::min(kT, s + chunk)).contiguous();  // the head's [B, c_h, V] buffer
          loss += streamed.objective->chunk_loss_and_grad(part, s);
          grad.slice(1, s, std::min(kT, s + chunk)).copy_(part);
        }
        CHECK(std::abs(loss - full_loss.item<double>()) <= 1e-12 * std::max(1.0, std::abs(full_loss.item<double>())));
        const double scale = leaf.grad().abs().max().item<double>();
        REQUIRE(scale > 0);
        CHECK((grad - leaf.grad()).abs().max().item<double>() <= 1e-12 * scale);
      }
    }
}

TEST_CASE("a row-term objective refuses a partial head chunk without the statistics pass", "[objective]") {
  auto p = make_problem("dpo");
  REQUIRE(p.objective->needs_statistics());
  auto logits = p.logits.slice(1, 0, 5).clone();
  CHECK_THROWS_WITH(p.objective->chunk_loss_and_grad(logits, 0), Catch::Contains("statistics pass"));
  // GRPO's sequence-level ratio without old_logps is 1 in value: its statistics are known without a pass.
  CHECK_FALSE(make_problem("grpo:importance=sequence", false).objective->needs_statistics());
  CHECK(make_problem("grpo:importance=sequence", true).objective->needs_statistics());
}

TEST_CASE("objective specs reject unknown keys and bad values, naming them", "[objective][spec]") {
  CHECK_THROWS_WITH(make_objective("grpo:betta=0.1"), Catch::Contains("unknown option 'betta'"));
  CHECK_THROWS_WITH(make_objective("grpo:loss_type=ppo"), Catch::Contains("loss_type=ppo") && Catch::Contains("dr_grpo"));
  CHECK_THROWS_WITH(make_objective("grpo:importance=row"), Catch::Contains("importance=row"));
  CHECK_THROWS_WITH(make_objective("grpo:beta=-1"), Catch::Contains("beta=-1"));
  CHECK_THROWS_WITH(make_objective("dpo:label_smoothing=0.7"), Catch::Contains("label_smoothing=0.7"));
  CHECK_THROWS_WITH(make_objective("sft:beta=1"), Catch::Contains("it takes none"));
  CHECK_THROWS_WITH(make_objective("ppo"), Catch::Contains("unknown objective 'ppo' (known: sft, grpo, dpo)"));
  // The canonical spec names every option and rebuilds the same objective.
  const auto grpo = make_objective("grpo:beta=0.04,loss_type=bnpo,temperature=0.9");
  CHECK(grpo->spec() == "grpo:beta=0.04,epsilon_low=0.2,epsilon_high=0.2,loss_type=bnpo,temperature=0.9,"
                        "importance=token,max_completion_length=256");
  CHECK(make_objective(grpo->spec())->spec() == grpo->spec());
  CHECK(make_objective("dpo")->spec() == "dpo:beta=0.1,label_smoothing=0");
}

TEST_CASE("objectives reject malformed batch tensors, naming the source and the tensor", "[objective][batch]") {
  const auto config = tiny_config();
  auto expect_rejected = [&](const std::string& spec, const std::function<void(Batch&)>& spoil, const std::string& what) {
    auto objective = make_objective(spec);
    Batch batch = objective->random_batch(config, {4, 12, 0.3, 0.25, 5, 2});
    if (spec.rfind("grpo", 0) == 0) {
      batch.fields["old_logps"] = at::zeros({4, 12}, at::kDouble);
      batch.fields["ref_logps"] = at::zeros({4, 12}, at::kDouble);
    }
    if (spec.rfind("dpo", 0) == 0) batch.fields["ref_logps"] = at::zeros({4}, at::kDouble);
    objective->prepare(batch, config, std::nullopt, "b.safetensors");  // the unspoiled batch is fine
    spoil(batch);
    INFO(spec << ": " << what);
    CHECK_THROWS_WITH(objective->prepare(batch, config, std::nullopt, "b.safetensors"),
                      Catch::Contains("b.safetensors") && Catch::Contains(what));
  };
  const std::string grpo = "grpo:beta=0.04";
  expect_rejected(grpo, [](Batch& b) { b.fields.erase("advantages"); }, "missing tensor 'advantages'");
  expect_rejected(grpo, [](Batch& b) { b.fields["advantages"] = at::zeros({3}, at::kDouble); }, "advantages has shape");
  expect_rejected(grpo, [](Batch& b) { b.fields["labels"] = b.input_ids; }, "unexpected tensor 'labels'");
  expect_rejected(grpo, [](Batch& b) { b.fields.erase("ref_logps"); }, "needs ref_logps in the batch or --ref");
  expect_rejected(grpo, [](Batch& b) { b.fields["old_logps"].fill_(std::nan("")); }, "old_logps holds a non-finite value");
  expect_rejected(grpo, [](Batch& b) {
    b.attention_mask[0][11] = 0;
    b.fields["completion_mask"][0][11] = 1;
  }, "completion_mask is 1 on a padded position");
  expect_rejected(grpo, [](Batch& b) { b.fields["completion_mask"][1][0] = 1; }, "completion_mask is 1 on token 0");
  expect_rejected(grpo, [](Batch& b) { b.fields["completion_mask"].zero_(); }, "no completion token");
  expect_rejected("grpo:loss_type=dr_grpo,max_completion_length=10", [](Batch& b) {
    b.attention_mask[0].fill_(1);  // row 0: tokens 1..11 all completion, one more than dr_grpo's normaliser allows
    b.fields["completion_mask"][0].fill_(1);
    b.fields["completion_mask"][0][0] = 0;
  }, "more than max_completion_length=10");
  expect_rejected("dpo", [](Batch& b) {
    b.input_ids = b.input_ids.slice(0, 0, 3);
    b.attention_mask = b.attention_mask.slice(0, 0, 3);
    b.fields["completion_mask"] = b.fields["completion_mask"].slice(0, 0, 3);
  }, "even number of rows");
  expect_rejected("dpo", [](Batch& b) { b.fields.erase("ref_logps"); }, "dpo needs ref_logps in the batch or --ref");
  expect_rejected("dpo", [](Batch& b) { b.fields["ref_logps"] = at::zeros({4, 12}, at::kDouble); }, "ref_logps has shape");
  expect_rejected("sft", [](Batch& b) { b.fields["completion_mask"] = b.attention_mask.clone(); },
                  "unexpected tensor 'completion_mask'");
}

TEST_CASE("the objective catalogue builds every entry from its name and its test specs, each spec round-tripping",
          "[objective][spec]") {
  CHECK(objective_names() == std::vector<std::string>{"sft", "grpo", "dpo"});
  for (const auto& e : objective_catalogue()) {
    INFO(e.name);
    REQUIRE_FALSE(e.test_specs.empty());
    CHECK(make_objective(e.name)->name() == e.name);
    CHECK(e.usage() == make_objective(e.name)->spec());  // --help shows the defaults the objective itself names
    CHECK(objectives_usage().find(e.usage()) != std::string::npos);
    for (const auto& spec : e.test_specs) {
      const auto built = make_objective(spec);
      CHECK(built->name() == e.name);
      CHECK(make_objective(built->spec())->spec() == built->spec());
    }
  }
  CHECK(typical_objective_specs() == std::vector<std::string>{"sft", "grpo:beta=0.04,loss_type=grpo", "dpo:beta=0.1"});
}
