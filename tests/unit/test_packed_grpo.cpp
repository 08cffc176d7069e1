// GRPO on packed rows (docs/packing.md "GRPO on packed rows"): verl's remove-padding layout, each packed sequence one
// completion with its own advantage. In fp64 and on every tensor, every method on packed rows gives the gradients of
// the same completions given one per right-padded row (the padded path is TRL's, tests/oracle/objective_parity.py),
// for every loss_type and both importance levels; each way of keeping a per-row term per row fails that gate.
#include <catch2/catch.hpp>

#include <cmath>
#include <memory>

#include <ATen/ATen.h>

#include "baselines/methods.h"
#include "core/methods/streaming.h"
#include "core/model/model.h"
#include "core/objectives/dpo.h"
#include "core/objectives/grpo.h"
#include "core/objectives/packed_batch.h"
#include "core/io/spec.h"
#include "core/model/context_attention.h"
#include "core/training/ring_exchange.h"
#include "core/training/sequence_parallel.h"
#include "core/training/sequence_scheme.h"
#include "tests/support/faulty_objectives.h"
#include "tests/support/gloo_ranks.h"
#include "tests/support/test_support.h"
#include "verify/grad_compare.h"

// A named namespace: the unity build puts this file beside test_packed_exactness.cpp, whose helpers share names.
namespace packed_grpo_tests {

using sbp::Batch;
using sbp::GrpoObjective;
using sbp::test::run_step;

constexpr double kFp64Rtol = 1e-10;  // the exactness gate of test_exactness.cpp
constexpr double kLossRtol = 1e-12;
constexpr std::int64_t kT = 48;

// test_packed_exactness.cpp's rows: a sequence of one token (no completion), sequences straddling every method's chunks,
// boundaries on a chunk's first position, the two rows packed differently. 10 sequences: groups of 2.
const std::vector<std::vector<std::int64_t>> kLengths = {{5, 1, 6, 12, 9, 3, 12}, {30, 2, 16}};

GrpoObjective grpo(const std::string& spec) { return GrpoObjective(sbp::parse_spec(spec, "objective")); }

// A packed GRPO batch of kLengths with old_logps (and ref_logps when beta > 0) drawn around the model's own packed
// log-probs, as `run --pack` makes them.
Batch packed_batch(const sbp::Model& model, const GrpoObjective& objective, std::uint64_t seed) {
  auto batch = sbp::packed_grpo_batch(model.config(), kLengths, 2, seed);
  objective.add_synthetic_logps(batch, sbp::sequence_logps(model, batch, objective.temperature()), seed,
                                /*reference_given=*/false);
  sbp::validate_tokens(batch, model.config(), "packed grpo");
  return batch;
}

struct Gate {
  double loss_error = 0;
  sbp::GradComparison gradients;
};
// `objective` on the packed `batch` by `spec`, against `padded`: the oracle's step on the same completions as padded
// rows (padded_step).
sbp::test::StepGradients padded_step(sbp::Model& model, sbp::Objective& oracle, const Batch& batch) {
  return run_step(model, "standard", oracle, sbp::padded_sequences(batch));
}
Gate against_padded(sbp::Model& model, const std::string& spec, sbp::Objective& objective,
                    const sbp::test::StepGradients& padded, const Batch& batch) {
  const auto step = run_step(model, spec, objective, batch);
  return {std::abs(step.loss - padded.loss) / std::abs(padded.loss),
          sbp::compare_gradients(padded.gradients, step.gradients)};
}

std::string worst_name(const Gate& gate) { return gate.gradients.worst() ? gate.gradients.worst()->name : ""; }

// The negative control of the cross-rank reduction: the all-gather's exchange, but each rank keeps the per-sequence
// statistics of its own positions (no sum over the group), so a sequence across ranks gets a ratio per rank.
class RankStatisticsExchange final : public sbp::KVExchange {
 public:
  explicit RankStatisticsExchange(sbp::SequenceParallel& inner) : inner_(inner) {}
  const sbp::SequenceShard& shard() const override { return inner_.shard(); }
  at::Tensor gather(const at::Tensor& local) override { return inner_.gather(local); }
  at::Tensor scatter_sum(const at::Tensor& whole) override { return inner_.scatter_sum(whole); }
  void sum_over_group(at::Tensor& values) override {
    auto copy = values.clone();  // the collective still runs on every rank; its sum is dropped
    inner_.sum_over_group(copy);
  }

 private:
  sbp::SequenceParallel& inner_;
};

TEST_CASE("every method on packed GRPO rows equals the same completions as padded rows in fp64",
          "[packed][grpo][exactness]") {
  // Each catalogue entry's edge settings on two cases (the sequence ratio, the token ratio with a reference); its
  // typical settings on the others (keeping the suite's budget).
  std::vector<std::string> edges = {"standard"}, typical = {"standard"};
  for (const auto& s : sbp::edge_method_specs(kT)) edges.push_back(s);
  for (const auto& s : sbp::typical_method_specs(kT)) typical.push_back(s);
  sbp::Model model(sbp::test::tiny_config(), at::kDouble, 51);
  double largest = 0;
  // Every loss_type, both importance levels, beta 0 and > 0, temperature != 1; and the sequence ratio without
  // old_logps (its statistics known before any chunk).
  struct Case {
    const char* objective;
    bool drop_old, all_edges;
  };
  for (const auto& [objective_spec, drop_old, all_edges] :
       {Case{"grpo:loss_type=grpo,beta=0.04,importance=sequence", false, true},
        Case{"grpo:loss_type=bnpo,beta=0", false, false},
        Case{"grpo:loss_type=dr_grpo,importance=sequence,temperature=0.7,max_completion_length=40", false, false},
        Case{"grpo:loss_type=dapo,beta=0.04,temperature=0.9", false, true},
        Case{"grpo:loss_type=grpo,importance=sequence,epsilon_high=0.28", true, false}}) {
    const auto& specs = all_edges ? edges : typical;
    auto objective = grpo(objective_spec);
    auto batch = packed_batch(model, objective, 52);
    if (drop_old) batch.fields.erase("old_logps");
    const auto padded = padded_step(model, objective, batch);
    for (const auto& spec : specs) {
      INFO(objective_spec << (drop_old ? " without old_logps" : "") << " by " << spec);
      const auto gate = against_padded(model, spec, objective, padded, batch);
      INFO("loss error " << gate.loss_error << ", worst tensor " << worst_name(gate) << " at "
                         << gate.gradients.max_normwise_rel());
      CHECK(gate.gradients.problems.empty());
      CHECK(gate.loss_error <= kLossRtol);
      CHECK(gate.gradients.passed(kFp64Rtol));
      largest = std::max(largest, gate.gradients.max_normwise_rel());
    }
  }
  WARN("largest fp64 normwise relative error of packed GRPO against its padded completions: " << largest);
}

TEST_CASE("packed GRPO micro-batches normalised by the step's sequences equal the whole packed batch",
          "[packed][grpo][exactness]") {
  // grpo and dr_grpo divide by the step's completions (TRL's per_token_loss.size(0)): of packed rows, its sequences.
  sbp::Model model(sbp::test::tiny_config(), at::kDouble, 53);
  for (const std::string objective_spec :
       {"grpo:loss_type=grpo,importance=sequence", "grpo:loss_type=dr_grpo,max_completion_length=40"}) {
    INFO(objective_spec);
    auto objective = grpo(objective_spec);
    const auto batch = packed_batch(model, objective, 54);
    const std::string spec = "streambp:layer_chunk=7,head_chunk=5";
    const auto whole = run_step(model, spec, objective, batch);
    const auto totals = objective.prepare(batch, model.config()).batch_totals();
    CHECK(totals.rows == 10);  // sequences, not rows
    const auto method = sbp::make_method(spec);
    model.zero_grad();
    const auto parts = objective.split(batch, 2, "packed");
    REQUIRE(parts[1].field("advantages").size(0) == 3);  // row 1's three sequences
    CHECK(at::equal(parts[1].field("advantages"), batch.field("advantages").slice(0, 7)));
    for (std::size_t k = 0; k < parts.size(); ++k)
      method->step(model, objective, parts[k], {.accumulate = k > 0, .step_totals = totals});
    const auto cmp = sbp::compare_gradients(whole.gradients, model.gradients());
    INFO("worst " << cmp.max_normwise_rel());
    CHECK(cmp.problems.empty());
    CHECK(cmp.passed(kFp64Rtol));
  }
}

TEST_CASE("the packed GRPO gate fails on a per-row advantage a whole-row ratio and a per-pack normaliser",
          "[packed][grpo][exactness][negative-control]") {
  sbp::Model model(sbp::test::tiny_config(), at::kDouble, 55);
  const auto options = sbp::parse_spec("grpo:loss_type=grpo,importance=sequence", "objective");
  GrpoObjective correct(options);
  sbp::test::PerRowAdvantageGrpo per_row_advantage(options);
  sbp::test::RowRatioGrpo row_ratio(options);
  sbp::test::PerPackNormalisedGrpo per_pack(options);
  const auto dapo_options = sbp::parse_spec("grpo:loss_type=dapo", "objective");
  GrpoObjective dapo(dapo_options);
  sbp::test::PerPackNormalisedGrpo per_pack_dapo(dapo_options);
  sbp::test::PerRowAdvantageGrpo per_row_advantage_token(dapo_options);
  const auto batch = packed_batch(model, correct, 56);
  const auto padded_batch = sbp::padded_sequences(batch);
  const auto padded = padded_step(model, correct, batch), padded_dapo = padded_step(model, dapo, batch);
  for (const std::string spec : {"standard", "streambp:layer_chunk=7,head_chunk=5"}) {
    INFO(spec);
    CHECK(against_padded(model, spec, correct, padded, batch).gradients.passed(kFp64Rtol));  // the controls
    CHECK(against_padded(model, spec, dapo, padded_dapo, batch).gradients.passed(kFp64Rtol));
    struct Fault {
      const char* what;
      sbp::Objective& faulty;
      sbp::Objective& oracle;
      const sbp::test::StepGradients& padded;
      bool per_row_too;  // wrong on unpacked rows as well (dapo's per-row mean is not its token mean)
    };
    for (const auto& [what, faulty, oracle, oracle_step, per_row_too] :
         {Fault{"advantage per row (sequence ratio)", per_row_advantage, correct, padded, false},
          Fault{"advantage per row (token ratio)", per_row_advantage_token, dapo, padded_dapo, false},
          Fault{"sequence-level ratio over the whole row", row_ratio, correct, padded, false},
          Fault{"normaliser per pack (grpo)", per_pack, correct, padded, false},
          Fault{"normaliser per pack (dapo)", per_pack_dapo, dapo, padded_dapo, true}}) {
      const auto gate = against_padded(model, spec, faulty, oracle_step, batch);
      INFO(what << ": worst " << worst_name(gate) << " at " << gate.gradients.max_normwise_rel());
      CHECK(gate.gradients.problems.empty());
      CHECK_FALSE(gate.gradients.passed(kFp64Rtol));
      CHECK(gate.gradients.max_normwise_rel() > 1e-6);
      CHECK_FALSE(worst_name(gate).empty());
      // On unpacked rows the faults of a per-row term are no fault: a row is its one sequence.
      if (!per_row_too && spec == "standard")
        CHECK(sbp::compare_gradients(oracle_step.gradients, run_step(model, spec, faulty, padded_batch).gradients)
                  .passed(kFp64Rtol));
    }
  }
}

TEST_CASE("packed GRPO with completions across ranks equals one process in fp64 under both schemes and fails "
          "without the group's sum of its sequence statistics",
          "[packed][grpo][sequence-parallel][distributed][negative-control]") {
  // test_packed_sequence_parallel.cpp's rows: over 2 ranks (zig-zag parts of 12) row 0's [8, 28) begins on rank 0 and
  // goes on over rank 1's parts, [28, 40) begins on rank 1 and ends on rank 0; over 3 ranks [8, 28) and row 1's
  // [0, 30) cross all three. A sequence's ratio sums its log-ratio over every rank holding it: each rank's [n]
  // statistics are summed over the group before any chunk's gradient.
  const std::vector<std::vector<std::int64_t>> lengths = {{7, 1, 20, 12, 8}, {30, 2, 16}};
  constexpr std::int64_t T = 48;
  sbp::Model reference_model(sbp::test::tiny_config(), at::kDouble, 58);
  double worst = 0;
  for (const std::string objective_spec :
       {"grpo:loss_type=grpo,importance=sequence", "grpo:loss_type=dr_grpo,beta=0.04,max_completion_length=40"}) {
    auto objective = grpo(objective_spec);
    auto batch = sbp::packed_grpo_batch(reference_model.config(), lengths, 2, 59);
    objective.add_synthetic_logps(batch, sbp::sequence_logps(reference_model, batch, objective.temperature()), 59,
                                  /*reference_given=*/false);
    const auto reference = run_step(reference_model, "standard", objective, batch);
    for (const auto scheme : {sbp::SequenceScheme::allgather, sbp::SequenceScheme::ring})
      for (const int world : {2, 3})
        for (const std::string method : {"standard", "checkpoint", "streambp:layer_chunk=5,head_chunk=7"}) {
          INFO(objective_spec << ", " << sbp::sequence_scheme_name(scheme) << ", " << world << " ranks, " << method);
          std::vector<double> errors(std::size_t(world), 0.0);
          sbp::test::run_gloo_ranks(world, [&](sbp::Communicator& comm) {
            sbp::Model model(sbp::test::tiny_config(), at::kDouble, 58);
            std::unique_ptr<sbp::KVSource> source;
            if (scheme == sbp::SequenceScheme::ring)
              source = std::make_unique<sbp::RingExchange>(comm, T);
            else
              source = std::make_unique<sbp::SequenceParallel>(comm, T);
            model.set_kv_source(source.get());
            auto gr = grpo(objective_spec);
            // Every rank holds the whole batch and its boundaries, at global positions.
            errors[std::size_t(comm.rank())] =
                sbp::test::group_sum_error(comm, run_step(model, method, gr, batch), reference);
          });
          const auto error = *std::max_element(errors.begin(), errors.end());
          INFO("largest relative difference " << error);
          CHECK(error <= 1e-12);
          worst = std::max(worst, error);
        }
  }
  WARN("packed GRPO over 2 and 3 ranks, both schemes: largest relative difference " << worst);

  // Without the group's sum each rank's sequence ratio is its own positions' (row 0's [8, 28) and [28, 40) straddle
  // both ranks): far from one process, through the whole-sequence head and StreamBP's streamed one alike.
  auto objective = grpo("grpo:loss_type=grpo,importance=sequence");
  auto batch = sbp::packed_grpo_batch(reference_model.config(), lengths, 2, 60);
  objective.add_synthetic_logps(batch, sbp::sequence_logps(reference_model, batch, 1.0), 60, false);
  const auto reference = run_step(reference_model, "standard", objective, batch);
  for (const std::string method : {"standard", "streambp:layer_chunk=5,head_chunk=7"}) {
    std::vector<double> errors(2, 0.0);
    sbp::test::run_gloo_ranks(2, [&](sbp::Communicator& comm) {
      sbp::Model model(sbp::test::tiny_config(), at::kDouble, 58);
      sbp::SequenceParallel sp(comm, T);
      RankStatisticsExchange faulty(sp);
      model.set_kv_source(&faulty);
      auto gr = grpo("grpo:loss_type=grpo,importance=sequence");
      errors[std::size_t(comm.rank())] = sbp::test::group_sum_error(comm, run_step(model, method, gr, batch), reference);
    });
    INFO(method << ": statistics of each rank's own positions, largest relative difference " << errors[0]);
    CHECK(errors[0] > 1e-6);
  }
}

TEST_CASE("packed GRPO input errors name the tensor the row and the position", "[packed][grpo][input]") {
  const auto config = sbp::test::tiny_config();
  auto objective = grpo("grpo");
  const auto batch = sbp::packed_grpo_batch(config, kLengths, 0, 57);
  CHECK(batch.field("advantages").size(0) == 10);
  CHECK_NOTHROW(objective.prepare(batch, config));

  auto per_row = batch;  // one advantage per row, as the padded layout gives them
  per_row.fields["advantages"] = at::zeros({2}, at::kDouble);
  CHECK_THROWS_WITH(objective.prepare(per_row, config, std::nullopt, "b.safetensors"),
                    Catch::Contains("b.safetensors: advantages has shape [2]") &&
                        Catch::Contains("one advantage per packed sequence, in the order of cu_seqlens ([10] here"));

  auto scored_first = batch;  // row 0's third sequence (from 6) given a completion token at its first position
  scored_first.fields["completion_mask"] = batch.field("completion_mask").clone();
  scored_first.fields["completion_mask"][0][6] = 1;
  CHECK_THROWS_WITH(objective.prepare(scored_first, config),
                    Catch::Contains("row 0, position 6: completion_mask is 1 on a packed sequence's first token"));

  sbp::RandomBatchOptions o;
  o.batch_size = 2, o.seq_len = 48, o.seed = 3, o.group = 7;
  o.pack = sbp::LengthDistribution::parse("fixed:length=12");  // 8 sequences
  // Groups of 7 consecutive sequences: the single eighth joins the first (a group of one has no spread).
  const auto ragged = objective.random_batch(config, o).field("advantages");
  REQUIRE(ragged.size(0) == 8);
  CHECK(std::abs(ragged.sum().item<double>()) < 1e-12);
  o.group = 3;  // 3 + 3 + 2
  const auto groups = objective.random_batch(config, o).field("advantages");
  for (const auto& [s, e] : {std::pair{0, 3}, {3, 6}, {6, 8}})
    CHECK(std::abs(groups.slice(0, s, e).sum().item<double>()) < 1e-12);
  o.group = 1;
  CHECK_THROWS_WITH(objective.random_batch(config, o), Catch::Contains("--group must be >= 2"));

  sbp::DpoObjective dpo(sbp::parse_spec("dpo", "objective"));
  auto dpo_batch = batch;
  dpo_batch.fields.erase("advantages");
  CHECK_THROWS_WITH(dpo.prepare(dpo_batch, config), Catch::Contains("matched across packs"));
}

}  // namespace packed_grpo_tests
