// GRPO and DPO through every BP method: checkpoint, MsT and StreamBP compute standard BP's loss and gradient in fp64 for
// every parameter tensor (normwise ≤ 1e-10), over seeded sweeps that reach every option of the objectives and every
// way a streamed head or layer can be cut (ARCHITECTURE.md §5: one objective code path shared by every method).
#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <random>
#include <set>
#include <sstream>

#include <ATen/ATen.h>

#include "baselines/methods.h"
#include "core/objectives/batch.h"
#include "core/model/lora.h"
#include "core/model/model.h"
#include "core/objectives/objective.h"
#include "core/methods/streaming.h"
#include "tests/support/test_support.h"
#include "verify/grad_compare.h"

using sbp::Batch;
using sbp::ModelConfig;
using sbp::test::describe;

namespace {

using sbp::test::kFp64Rtol;
using sbp::test::kLossRtol;

struct ObjectiveCase {
  ModelConfig config;
  std::string objective;
  sbp::RandomBatchOptions batch;
  bool drop_old_logps = false;
  std::string lora;  // LoRA spec, or "" for full fine-tuning
  std::int64_t layer_chunk = 1, head_chunk = 1, mini_seq = 1;
  std::uint64_t model_seed = 0;

  // Every method of the catalogue but standard BP (the reference), its options set by this draw: StreamBP's chunks and
  // MsT's mini-sequences by name; an option the sweep does not know (a new method's) takes the layer chunk's draw,
  // which reaches the same four relations to T.
  std::vector<std::string> method_specs() const {
    const std::map<std::string, std::int64_t> drawn = {
        {"layer_chunk", layer_chunk}, {"head_chunk", head_chunk}, {"mini_seq", mini_seq}};
    std::vector<std::string> out;
    for (const auto& e : sbp::builtin_method_entries()) {
      if (e.name == "standard") continue;
      std::string spec = e.name;
      for (const auto& o : e.options) {
        const auto it = drawn.find(o.key);
        spec += (spec == e.name ? ":" : ",") + o.key + "=" +
                std::to_string(std::max(o.minimum, it != drawn.end() ? it->second : layer_chunk));
      }
      out.push_back(spec);
    }
    return out;
  }
  std::string id() const {
    std::ostringstream s;
    s << "OBJECTIVE(" << objective << (drop_old_logps ? ",no old_logps" : "") << (lora.empty() ? "" : ",lora " + lora) << ",T=" << batch.seq_len
      << ",B=" << batch.batch_size << ",G=" << batch.group << ",pad=" << batch.pad_fraction << ",c=" << layer_chunk
      << ",c_h=" << head_chunk << ",M=" << mini_seq << "," << describe(config) << ",model_seed=" << model_seed
      << ",batch_seed=" << batch.seed << ")";
    return s.str();
  }
};

// A draw of the sweep: small models of every attention layout, T and chunks in the four relations a chunk loop can
// get wrong (remainder, one token, one chunk, equal chunks), ragged prompts and completions.
template <typename Rng>
ObjectiveCase draw_common(Rng& rng, int i) {
  auto pick = [&](std::initializer_list<std::int64_t> values) {
    return *(values.begin() + std::uniform_int_distribution<std::size_t>(0, values.size() - 1)(rng));
  };
  auto between = [&](std::int64_t lo, std::int64_t hi) { return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng); };
  auto coin = [&] { return std::bernoulli_distribution(0.5)(rng); };
  ObjectiveCase k;
  ModelConfig& c = k.config;
  c.name = "objective-sweep";
  c.head_dim = pick({8, 16});
  c.num_attention_heads = pick({2, 4});
  c.num_key_value_heads = coin() ? c.num_attention_heads : pick({1, 2});
  c.hidden_size = pick({32, 48});
  c.intermediate_size = pick({32, 64});
  c.num_hidden_layers = pick({1, 2});
  c.vocab_size = pick({64, 128});
  c.tie_word_embeddings = coin();
  c.qk_norm = coin();
  c.attention_bias = coin();
  c.o_proj_bias = coin();
  std::int64_t T = 0;
  switch (i % 4) {
    case 0:
      T = between(6, 40);
      do k.layer_chunk = between(2, T - 1);
      while (T % k.layer_chunk == 0);
      break;
    case 1:
      T = between(4, 12);
      k.layer_chunk = 1;
      break;
    case 2:
      T = between(4, 40);
      k.layer_chunk = T + pick({0, 3});
      break;
    default:
      k.layer_chunk = between(2, 8);
      T = k.layer_chunk * between(2, 5);
      break;
  }
  switch (between(0, 2)) {
    case 0: k.head_chunk = 1; break;
    case 1: k.head_chunk = between(2, T); break;
    default: k.head_chunk = T + pick({0, 2}); break;
  }
  k.mini_seq = between(1, T + 2);  // MsT: mini-sequences of ceil(T / M) positions, remainders and M > T included
  k.batch.seq_len = T;
  k.batch.pad_fraction = double(pick({0, 20, 40})) / 100.0;
  k.batch.prompt_fraction = 0.0;  // prompt lengths drawn per group
  k.batch.seed = std::uint64_t(between(0, 1 << 20));
  k.model_seed = std::uint64_t(between(0, 1 << 20));
  return k;
}

std::vector<ObjectiveCase> grpo_cases(int count) {
  std::mt19937_64 rng(20251122);
  auto pick_double = [&](std::initializer_list<double> values) {
    return *(values.begin() + std::uniform_int_distribution<std::size_t>(0, values.size() - 1)(rng));
  };
  const char* loss_types[] = {"grpo", "bnpo", "dr_grpo", "dapo"};
  std::vector<ObjectiveCase> cases;
  for (int i = 0; i < count; ++i) {
    auto k = draw_common(rng, i);
    const auto G = std::uniform_int_distribution<std::int64_t>(2, 3)(rng);
    k.batch.group = G;
    k.batch.batch_size = G * std::uniform_int_distribution<std::int64_t>(1, 2)(rng);
    std::ostringstream spec;
    spec << "grpo:beta=" << pick_double({0.0, 0.04, 0.3}) << ",loss_type=" << loss_types[(i / 4) % 4]
         << ",importance=" << ((i / 2) % 2 ? "sequence" : "token") << ",temperature=" << pick_double({1.0, 0.9, 0.7, 1.3})
         << ",epsilon_high=" << pick_double({0.2, 0.28}) << ",max_completion_length=" << k.batch.seq_len;
    k.objective = spec.str();
    k.drop_old_logps = i % 5 == 4;
    cases.push_back(k);
  }
  return cases;
}

std::vector<ObjectiveCase> sft_cases(int count) {
  std::mt19937_64 rng(20251124);
  std::vector<ObjectiveCase> cases;
  for (int i = 0; i < count; ++i) {
    auto k = draw_common(rng, i);
    k.batch.batch_size = std::uniform_int_distribution<std::int64_t>(1, 3)(rng);
    k.batch.prompt_fraction = i % 2 ? 0.3 : 0.0;
    k.objective = "sft";
    cases.push_back(k);
  }
  return cases;
}

// LoRA on a case: rank 1..4, alpha as PEFT's default 2r or another value, all seven projections or a subset, and
// init=random so that A and B both carry gradient from the first step.
template <typename Rng>
void add_lora(ObjectiveCase& k, Rng& rng, int i) {
  const std::int64_t rank = std::uniform_int_distribution<std::int64_t>(1, 4)(rng);
  std::ostringstream spec;
  spec << "rank=" << rank << ",alpha=" << (i % 2 ? 2.0 * double(rank) : 3.5);
  if (i % 3 == 0) {
    spec << ",targets=all-linear";
  } else {
    std::string list;
    for (const auto& t : sbp::lora_target_names())
      if (std::bernoulli_distribution(0.5)(rng)) list += (list.empty() ? "" : ",") + t;
    spec << ",targets=" << (list.empty() ? "down" : list);
  }
  spec << ",init=random";
  k.lora = spec.str();
}

std::vector<ObjectiveCase> dpo_cases(int count) {
  std::mt19937_64 rng(20251123);
  auto pick_double = [&](std::initializer_list<double> values) {
    return *(values.begin() + std::uniform_int_distribution<std::size_t>(0, values.size() - 1)(rng));
  };
  std::vector<ObjectiveCase> cases;
  for (int i = 0; i < count; ++i) {
    auto k = draw_common(rng, i);
    k.batch.batch_size = 2 * std::uniform_int_distribution<std::int64_t>(1, 2)(rng);  // P = 1 or 2 pairs
    std::ostringstream spec;
    spec << "dpo:beta=" << pick_double({0.1, 0.5, 2.0}) << ",label_smoothing=" << ((i / 3) % 2 ? 0.1 : 0.0);
    k.objective = spec.str();
    cases.push_back(k);
  }
  return cases;
}

// Runs one case through standard BP and every other method of the catalogue; returns the largest normwise error, and notes what the
// case exercised into `covered`.
double check_case(const ObjectiveCase& k, std::set<std::string>& covered) {
  INFO(k.id());
  sbp::Model model(k.config, at::kDouble, k.model_seed);
  if (!k.lora.empty()) model.add_lora(sbp::parse_lora_spec(k.lora), k.model_seed + 1);
  auto objective = sbp::make_objective(k.objective);
  Batch batch = sbp::test::objective_batch(model, *objective, k.batch);
  if (k.drop_old_logps) batch.fields.erase("old_logps");
  sbp::validate_tokens(batch, k.config, k.id());
  const auto standard = sbp::test::run_step(model, "standard", *objective, batch);
  REQUIRE(standard.gradients.size() == model.trainable().size());
  double worst = 0;
  for (const auto& spec : k.method_specs()) {
    INFO(spec);
    const auto other = sbp::test::run_step(model, spec, *objective, batch);
    CHECK(std::abs(standard.loss - other.loss) <= kLossRtol * std::max(1.0, std::abs(standard.loss)));
    const auto cmp = sbp::compare_gradients(standard.gradients, other.gradients);
    CHECK(cmp.problems.empty());
    INFO("largest normwise relative error " << cmp.max_normwise_rel() << " in " << (cmp.worst() ? cmp.worst()->name : "-"));
    CHECK(cmp.passed(kFp64Rtol));
    worst = std::max(worst, cmp.max_normwise_rel());
  }

  const auto T = k.batch.seq_len;
  if (k.layer_chunk < T && T % k.layer_chunk != 0) covered.insert("T not a multiple of layer_chunk");
  if (k.layer_chunk == 1) covered.insert("layer_chunk 1");
  if (k.head_chunk < T && T % k.head_chunk != 0) covered.insert("T not a multiple of head_chunk");
  if (k.head_chunk >= T) covered.insert("head_chunk >= T");
  if (const auto len = (T + k.mini_seq - 1) / k.mini_seq; T % len != 0) covered.insert("MsT remainder mini-sequence");
  if ((batch.attention_mask == 0).any().item<bool>()) covered.insert("ragged right padding");
  covered.insert("B=" + std::to_string(k.batch.batch_size));
  for (const char* key : {"loss_type=grpo,", "loss_type=bnpo", "loss_type=dr_grpo", "loss_type=dapo", "importance=token",
                          "importance=sequence", "beta=0,", "label_smoothing=0.1"})
    if (k.objective.find(key) != std::string::npos) covered.insert(key);
  if (k.objective.find("beta=0,") == std::string::npos) covered.insert("beta>0");
  if (k.objective.find("temperature=1,") == std::string::npos && k.objective.rfind("grpo", 0) == 0)
    covered.insert("temperature!=1");
  if (k.drop_old_logps) covered.insert("without old_logps");
  if (!k.lora.empty()) covered.insert(k.lora.find("all-linear") != std::string::npos ? "LoRA all-linear" : "LoRA subset");
  if (batch.has("old_logps")) {
    // Clipping is active where a completion token's ratio leaves [1 - eps_low, 1 + eps_high] (eps_high <= 0.28).
    const auto logp = sbp::sequence_logps(model, batch.input_ids, objective->temperature());
    const auto ratio = at::exp(logp - batch.field("old_logps"));
    const auto on = batch.field("completion_mask") == 1;
    if (((ratio < 0.8) & on).any().item<bool>() && ((ratio > 1.28) & on).any().item<bool>())
      covered.insert("clipping active on both sides");
  }
  return worst;
}

void require_coverage(const std::set<std::string>& covered, std::initializer_list<const char*> corners) {
  for (const char* corner : corners) {
    INFO("the sweep must reach: " << corner);
    CHECK(covered.count(corner) == 1);
  }
}

}  // namespace

TEST_CASE("GRPO gradients of every method equal standard BP in fp64 for every parameter",
          "[exactness][objective][grpo]") {
  std::set<std::string> covered;
  double worst = 0;
  for (const auto& k : grpo_cases(56)) worst = std::max(worst, check_case(k, covered));
  WARN("GRPO: largest fp64 normwise relative error over 56 cases x the catalogue's other methods: " << worst);
  require_coverage(covered, {"T not a multiple of layer_chunk", "layer_chunk 1", "T not a multiple of head_chunk",
                             "head_chunk >= T", "MsT remainder mini-sequence", "ragged right padding", "B=2", "B=3", "B=4", "B=6", "loss_type=grpo,",
                             "loss_type=bnpo", "loss_type=dr_grpo", "loss_type=dapo", "importance=token",
                             "importance=sequence", "beta=0,", "beta>0", "temperature!=1", "without old_logps",
                             "clipping active on both sides"});
}

TEST_CASE("DPO gradients of every method equal standard BP in fp64 for every parameter",
          "[exactness][objective][dpo]") {
  std::set<std::string> covered;
  double worst = 0;
  for (const auto& k : dpo_cases(52)) worst = std::max(worst, check_case(k, covered));
  WARN("DPO: largest fp64 normwise relative error over 52 cases x the catalogue's other methods: " << worst);
  require_coverage(covered, {"T not a multiple of layer_chunk", "layer_chunk 1", "T not a multiple of head_chunk",
                             "head_chunk >= T", "MsT remainder mini-sequence", "ragged right padding", "B=2", "B=4",
                             "label_smoothing=0.1", "beta>0"});
}

TEST_CASE("LoRA adapter gradients of every method equal standard BP in fp64, for every objective",
          "[exactness][objective][lora]") {
  std::mt19937_64 rng(20251125);
  for (auto cases : {sft_cases(30), grpo_cases(30), dpo_cases(30)}) {
    std::set<std::string> covered;
    double worst = 0;
    for (int i = 0; i < int(cases.size()); ++i) {
      add_lora(cases[i], rng, i);
      worst = std::max(worst, check_case(cases[i], covered));
    }
    WARN(cases.front().objective.substr(0, 4) << " + LoRA: largest fp64 normwise relative error over " << cases.size()
                                              << " cases x the catalogue's other methods: " << worst);
    require_coverage(covered, {"LoRA all-linear", "LoRA subset", "T not a multiple of layer_chunk",
                               "T not a multiple of head_chunk", "MsT remainder mini-sequence", "ragged right padding"});
  }
}
