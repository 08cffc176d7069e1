// Each feature of a workload adds its own terms to the memory models (workload.h's hooks): they appear in the
// estimate exactly when the feature is there, whatever other features are there beside it.
#include <catch2/catch.hpp>

#include <functional>
#include <string>
#include <vector>

#include "baselines/methods.h"
#include "core/methods/memory_terms.h"
#include "core/model/sequence_shard.h"
#include "core/training/training_memory.h"
#include "tests/support/test_support.h"

namespace {

// A StreamBP training step of tiny (full fine-tuning, fp32) with an optimizer's states, on one process.
sbp::Workload base_workload() {
  sbp::Workload w;
  w.config = sbp::test::tiny_config();
  w.batch_size = 2;
  w.seq_len = 64;
  w.workspaces = sbp::no_kernel_workspaces();
  w.optimizer_state_bytes = 2 * w.config.num_parameters() * 4;
  w.optimizer_update_bytes = 1024;
  return w;
}

using Names = std::function<std::vector<std::string>(const sbp::Workload&)>;

// Where a feature's terms show: a training step's offload tier at its peak, the tier's timeline, the moments beside the
// method's, a training step's moments.
std::vector<std::string> host_terms(const sbp::Workload& w) {
  std::vector<std::string> names;
  for (const auto& t : sbp::training_memory(*sbp::make_method("streambp"), w).host) names.push_back(t.name);
  return names;
}
// Every instant of the tier's timeline, not only its peak (which one holds the most depends on the other features).
std::vector<std::string> tier_terms(const sbp::Workload& w) {
  const sbp::memory::Sizes z(w);
  sbp::memory::TierTimeline tier(z);
  sbp::memory::for_each_feature(w, [&](const auto& f) {
    if constexpr (requires { f.add_tier_terms(z, tier); }) f.add_tier_terms(z, tier);
  });
  std::vector<std::string> names;
  for (const auto& instant : tier.instants)
    for (const auto& t : instant.terms) names.push_back(t.name);
  for (const auto& t : tier.whole_step) names.push_back(t.name);
  return names;
}
std::vector<std::string> moments(const sbp::Workload& w) {
  std::vector<std::string> names;
  for (const auto& m : sbp::memory::feature_moments(w, /*streamed=*/true)) names.push_back(m.moment);
  return names;
}
std::vector<std::string> step_moments(const sbp::Workload& w) {
  sbp::memory::StepMoments step;
  sbp::memory::add_feature_step_moments(w, step);
  std::vector<std::string> names;
  for (const auto& m : step.moments) names.push_back(m.moment);
  for (const auto& t : step.host) names.push_back(t.name);
  return names;
}
// Sequence parallelism's terms are written in the shard's positions (Sizes::T), which only it sets.
std::vector<std::string> shard_positions(const sbp::Workload& w) {
  const sbp::memory::Sizes z(w);
  return {"T = " + std::to_string(z.T)};
}

struct FeatureCase {
  sbp::WorkloadFeature feature;
  Names names;
  std::string term;  // a part of the name of one of its terms
};

bool shows(const std::vector<std::string>& names, const std::string& term) {
  for (const auto& n : names)
    if (n.find(term) != std::string::npos) return true;
  return false;
}

}  // namespace

TEST_CASE("each workload feature's memory terms appear in the estimate exactly when the feature is there",
          "[memory-model][features]") {
  using sbp::OffloadKind;
  const std::vector<FeatureCase> cases = {
      {sbp::Offload{OffloadKind::checkpoints}, tier_terms, "layer checkpoints"},
      {sbp::Offload{OffloadKind::gradients}, tier_terms, "gradients"},
      {sbp::Offload{OffloadKind::parameters}, tier_terms, "parameter"},  // one process's, or ZeRO-3's slices
      {sbp::Offload{OffloadKind::optimizer}, host_terms, "optimizer states"},
      {sbp::DataParallelism{.world_size = 2, .zero_stage = 3, .collective_copies = true}, moments,
       "gradient reduction"},
      {sbp::DataParallelism{.world_size = 2, .zero_stage = 3, .collective_copies = true}, step_moments,
       "gradient norm"},
      {sbp::SequenceParallelism{2}, shard_positions,
       "T = " + std::to_string(sbp::longest_zigzag_shard(base_workload().seq_len, 2))},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const auto& c = cases[i];
    INFO("case " << i << ": " << c.term);
    // Beside every other case's feature of another kind (one of the same kind would replace it).
    auto others = base_workload();
    for (const auto& other : cases)
      if (other.feature.index() != c.feature.index() ||
          (std::holds_alternative<sbp::Offload>(c.feature) &&
           std::get<sbp::Offload>(other.feature).kind != std::get<sbp::Offload>(c.feature).kind))
        others.add(other.feature);
    auto with = others;
    with.add(c.feature);
    auto alone = base_workload();
    alone.add(c.feature);
    CHECK(shows(c.names(alone), c.term));
    CHECK(shows(c.names(with), c.term));
    CHECK_FALSE(shows(c.names(base_workload()), c.term));
    CHECK_FALSE(shows(c.names(others), c.term));
  }
}

TEST_CASE("a workload's features are kept in one order whatever order they were added in", "[memory-model][features]") {
  auto a = base_workload(), b = base_workload();
  a.add(sbp::SequenceParallelism{2});
  a.add(sbp::Offload{sbp::OffloadKind::parameters});
  a.add(sbp::DataParallelism{.world_size = 4, .zero_stage = 3});
  a.add(sbp::Offload{sbp::OffloadKind::checkpoints});
  b.add(sbp::Offload{sbp::OffloadKind::checkpoints});
  b.add(sbp::DataParallelism{.world_size = 4, .zero_stage = 3});
  b.add(sbp::Offload{sbp::OffloadKind::parameters});
  b.add(sbp::SequenceParallelism{2});
  b.add(sbp::SequenceParallelism{2});  // the same kind again replaces it
  REQUIRE(a.features.size() == 4);
  REQUIRE(b.features.size() == 4);
  const auto ea = sbp::training_memory(*sbp::make_method("streambp"), a);
  const auto eb = sbp::training_memory(*sbp::make_method("streambp"), b);
  CHECK(ea.moment == eb.moment);
  REQUIRE(ea.host.size() == eb.host.size());
  for (std::size_t i = 0; i < ea.host.size(); ++i) CHECK(ea.host[i].name == eb.host[i].name);
  REQUIRE(ea.terms.size() == eb.terms.size());
  for (std::size_t i = 0; i < ea.terms.size(); ++i) {
    CHECK(ea.terms[i].name == eb.terms[i].name);
    CHECK(ea.terms[i].bytes == eb.terms[i].bytes);
  }
}
