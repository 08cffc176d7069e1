// The conformance matrix's training-path cases (issue #45): every micro-batch case splits its rows exactly once
// (DPO: whole pairs), and its micro-batches hold different target counts, so that a normalisation per micro-batch
// cannot pass it by accident; the case-set checks and result.json's micro-batch count name what is wrong.
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <ATen/ATen.h>

#include "core/model/lora.h"
#include "core/model/model.h"
#include "core/objectives/objective.h"
#include "core/objectives/packed_batch.h"
#include "experiments/batches.h"
#include "tests/support/test_support.h"
#include "verify/conform_packed.h"
#include "verify/conformance.h"
#include "verify/grad_compare.h"
#include <nlohmann/json.hpp>

namespace {

// What the objective normalises a micro-batch by: its scored tokens (SFT; GRPO bnpo/dapo) or its rows (packed GRPO:
// its sequences).
std::int64_t target_count(const sbp::ConformCase& c, const sbp::Batch& micro) {
  const bool by_rows = c.objective.rfind("dpo", 0) == 0 || c.objective.find("loss_type=grpo") != std::string::npos ||
                       c.objective.find("dr_grpo") != std::string::npos;
  if (by_rows) return micro.packed ? micro.packed->sequences() : micro.batch_size();  // packed GRPO: its sequences
  const auto scored = micro.has("labels") ? micro.field("labels").slice(1, 1).ne(-100)
                                          : micro.field("completion_mask").slice(1, 1).ne(0);
  return scored.sum().item<std::int64_t>();
}

}  // namespace

TEST_CASE("every micro-batch case of the case sets splits its rows once into micro-batches of different target counts",
          "[conform]") {
  int micro_cases = 0;
  for (const auto* set : {"quick", "full", "survey"}) {
    bool tied = false, untied = false;
    for (const auto& c : sbp::conform_cases(set)) {
      (c.config.tie_word_embeddings ? tied : untied) = true;
      if (c.micro_batches.empty()) continue;
      ++micro_cases;
      INFO(set << ": " << c.name);
      REQUIRE(c.micro_batches.size() >= 2);
      CHECK(sbp::micro_batches_problem(c, c.batch.batch_size).empty());
      const auto batch = sbp::conform_batch(c, *sbp::make_objective(c.objective));
      std::set<std::int64_t> counts;
      for (const auto& micro : sbp::micro_batch_split(c, batch)) counts.insert(target_count(c, micro));
      CHECK(counts.size() > 1);
    }
    INFO(set);
    CHECK((tied && untied));  // tied and untied heads side by side in every set
  }
  CHECK(micro_cases >= 6);
}

TEST_CASE("conform names malformed micro-batches and a result.json whose micro-batch count is missing or wrong",
          "[conform]") {
  sbp::ConformCase c;
  c.micro_batches = {{0, 1}, {1}};
  CHECK(sbp::micro_batches_problem(c, 3) == "micro_batches: row 1 appears twice");
  c.micro_batches = {{0, 5}};
  CHECK(sbp::micro_batches_problem(c, 3) == "micro_batches[0]: row 5 of a batch of 3 rows");
  c.objective = "dpo";
  c.micro_batches = {{0, 2}, {1, 3}};
  CHECK(sbp::micro_batches_problem(c, 4).empty());
  c.micro_batches = {{0, 1}, {2, 3}};  // rows 0 and 1 are both chosen rows
  CHECK_THAT(sbp::micro_batches_problem(c, 4), Catch::Contains("chosen rows, then their rejected rows (row + 2)"));

  CHECK(sbp::result_micro_batches_problem(R"({"loss": 1.0, "micro_batches": 3})", 3).empty());
  CHECK_THAT(sbp::result_micro_batches_problem(R"({"loss": NaN})", 3),
             Catch::StartsWith("result.json has no \"micro_batches\"; the case's step is 3 micro-batches"));
  CHECK_THAT(sbp::result_micro_batches_problem(R"({"loss": 1, "micro_batches": 2})", 3),
             Catch::StartsWith("result.json: 2 micro-batches ran"));
  CHECK_THAT(sbp::result_micro_batches_problem(R"({"loss": 1, "micro_batches": "3"})", 3),
             Catch::StartsWith("result.json: \"micro_batches\" is \"3\", not an integer"));
}

TEST_CASE("train's --micro-batches parses rows per micro-batch and the objective checks them as conform's cases are",
          "[conform][train]") {
  using Rows = sbp::MicroBatchRows;
  CHECK(sbp::parse_micro_batch_rows("0;1,2;3", "--micro-batches") == Rows{{0}, {1, 2}, {3}});
  for (const char* bad : {"0;1,x", "0;-1", "0;1 ,2", "0;;1"}) {
    INFO(bad);
    if (std::string(bad) == "0;;1") {  // parses to an empty micro-batch, which the row check names
      CHECK(sbp::micro_batch_rows_problem(sbp::parse_micro_batch_rows(bad, "--micro-batches"), 2, false) ==
            "micro_batches[1] is empty");
      continue;
    }
    CHECK_THROWS_AS(sbp::parse_micro_batch_rows(bad, "--micro-batches"), sbp::InputError);
  }
  // The objective selects the rows, DPO's pairs kept together; a row left out is named with the batch's source.
  const auto sft = sbp::make_objective("sft");
  sbp::ModelConfig config;
  config.vocab_size = 32;
  const auto batch = sft->random_batch(config, {.batch_size = 4, .seq_len = 6, .seed = 3});
  const auto micro = sft->micro_batches(batch, {{0}, {1, 2}, {3}}, "b.safetensors");
  REQUIRE(micro.size() == 3);
  CHECK(micro[1].batch_size() == 2);
  CHECK(at::equal(micro[1].input_ids, batch.input_ids.slice(0, 1, 3)));
  CHECK_THROWS_WITH(sft->micro_batches(batch, {{0}, {1, 2}}, "b.safetensors"),
                    "b.safetensors: micro_batches: row 3 is in no micro-batch");
  const auto dpo = sbp::make_objective("dpo");
  CHECK_THROWS_WITH(dpo->micro_batches(batch, {{0, 1}, {2, 3}}, "b.safetensors"),
                    Catch::Contains("chosen rows, then their rejected rows (row + 2)"));
  CHECK(dpo->micro_batches(batch, {{0, 2}, {1, 3}}, "b.safetensors").size() == 2);
}

TEST_CASE("a warm worker's cpu_seconds in result.json is added, and only a finite non-negative number counts",
          "[conformance]") {
  CHECK(sbp::result_worker_cpu_seconds(R"({"loss": 1.0, "cpu_seconds": 2.5})") == 2.5);
  CHECK(sbp::result_worker_cpu_seconds(R"({"loss": NaN, "micro_batches": 3})") == 0);  // a cold adapter writes none
  CHECK(sbp::result_worker_cpu_seconds(R"({"loss": 1, "cpu_seconds": -1})") == 0);
  CHECK(sbp::result_worker_cpu_seconds(R"({"loss": 1, "cpu_seconds": Infinity})") == 0);
  CHECK(sbp::result_worker_cpu_seconds(R"({"loss": 1, "cpu_seconds": "2"})") == 0);
  CHECK(sbp::result_worker_cpu_seconds(R"({"loss": 1, "cpu_)") == 0);  // malformed: result_loss reports it
}

TEST_CASE("every case set names each case once, and a name is one case in every set that holds it", "[conform]") {
  std::map<std::string, sbp::ConformCase> by_name;
  for (const auto& set : sbp::conform_case_sets()) {
    std::set<std::string> names;
    for (const auto& c : sbp::conform_cases(set)) {
      INFO(set << ": " << c.name);
      CHECK(names.insert(c.name).second);  // --only, pytest's items and JUnit's rows select a case by its name
      const auto [it, fresh] = by_name.emplace(c.name, c);
      if (fresh) continue;
      const auto& first = it->second;
      CHECK(first.description == c.description);
      CHECK(first.config.name == c.config.name);
      CHECK(first.dtype == c.dtype);
      CHECK(first.objective == c.objective);
      CHECK(first.lora == c.lora);
      CHECK((first.batch.seed == c.batch.seed && first.batch.seq_len == c.batch.seq_len &&
             first.batch.batch_size == c.batch.batch_size));
      CHECK(first.micro_batches == c.micro_batches);
      CHECK(first.pack_lengths == c.pack_lengths);
    }
  }
  CHECK(by_name.count("sft-gqa-qknorm-tied"));
  CHECK(by_name.count("sft-arch-gqa-qknorm-tied"));  // full's architecture grid, apart from quick's case
}

TEST_CASE("a case file that names two cases alike is bad input naming both", "[conform]") {
  const auto file = std::filesystem::temp_directory_path() / "streambp-test-duplicate-cases.json";
  std::ofstream(file) << R"([{"name": "a"}, {"name": "b"}, {"name": "a", "seq": 9}])";
  CHECK_THROWS_WITH(sbp::conform_cases(file.string()),
                    Catch::Contains("case 2: name 'a' is case 0's too: every case needs its own name"));
  std::filesystem::remove(file);
}

// The packed cases (issue #59): in every set, each with what the issue asks of packed rows, and the batch they write is
// what DataCollatorWithFlattening would have made of their sequences (plus a ragged tail's padding).
TEST_CASE("every case set has packed cases whose rows are what their pack_lengths say", "[conform][packed]") {
  bool straddles = false, single = false, ragged = false, micro_packs = false;
  bool grpo_straddles = false, grpo_single_token_completion = false, grpo_micro_packs = false;
  for (const auto& set : sbp::conform_case_sets()) {
    if (set == "rl" || set == "rl-verl") continue;  // whole RL steps only (issue #60): no batch of rows to pack
    int packed = 0, packed_grpo = 0;
    for (const auto& c : sbp::conform_cases(set)) {
      if (c.pack_lengths.empty()) continue;
      ++packed;
      INFO(set << ": " << c.name);
      REQUIRE(sbp::pack_lengths_problem(c).empty());
      const auto objective = sbp::make_objective(c.objective);
      auto b = sbp::conform_batch(c, *objective);
      REQUIRE(b.packed);
      sbp::validate_tokens(b, c.config, c.name);
      const bool grpo = c.objective.rfind("grpo", 0) == 0;
      if (grpo) {  // its old (and reference) log-probs, as conform completes the batch before writing it
        sbp::Model model(c.config, c10::kDouble, c.batch.seed);
        sbp::complete_batch(model, *objective, b, "random batch", true, "", c10::kDouble, c.batch.seed);
      }
      objective->prepare(b, c.config);  // the separators -100, no completion on a first token (throws naming them)
      const auto T = c.batch.seq_len;
      packed_grpo += grpo;
      // GRPO: each sequence one completion (completion_mask), its own advantage; SFT: labels as the collator's
      const auto labels = grpo ? b.field("completion_mask") : b.field("labels");
      if (grpo) CHECK(b.field("advantages").sizes() == at::IntArrayRef{b.packed->sequences()});
      for (std::size_t r = 0; r < c.pack_lengths.size(); ++r) {
        const auto row = std::int64_t(r);
        std::int64_t start = 0;
        for (const auto L : c.pack_lengths[r]) {
          CHECK(b.packed->sequence_start(row, start) == start);
          CHECK(b.packed->sequence_end(row, start) == start + L);
          CHECK(labels[row][start].item<std::int64_t>() == (grpo ? 0 : -100));
          const auto completion = grpo ? labels[row].slice(0, start, start + L).sum().item<std::int64_t>() : 0;
          for (const auto chunk : {c.layer_chunk, c.head_chunk})
            if ((start + L - 1) / chunk > start / chunk) (grpo ? grpo_straddles : straddles) = true;
          if (grpo) CHECK(completion >= 1);  // every packed sequence a completion
          grpo_single_token_completion = grpo_single_token_completion || (grpo && completion == 1);
          single = single || L == 1;
          start += L;
        }
        if (grpo) CHECK(start == T);  // GRPO's rows are full
        CHECK(b.attention_mask[row].sum().item<std::int64_t>() == start);  // the padding after the last sequence only
        if (start < T) {
          ragged = true;
          CHECK(labels[row].slice(0, start).eq(-100).all().item<bool>());
          CHECK(b.packed->sequence_start(row, start) == start);  // the padding a segment of its own
        }
      }
      if (!c.micro_batches.empty())
        for (const auto& rows : c.micro_batches)
          if (rows.size() >= 2 && c.pack_lengths[std::size_t(rows[0])] != c.pack_lengths[std::size_t(rows[1])])
            (grpo ? grpo_micro_packs : micro_packs) = true;
      const auto j = sbp::case_json(c, *objective);
      CHECK(j.at("packed") == true);
      // the tensors one value per sequence, named for readers (an SFT case.json stays as it was)
      CHECK(j.value("per_sequence", nlohmann::json()) ==
            (grpo ? nlohmann::json::array({"advantages"}) : nlohmann::json()));
      CHECK(j.at("sequences").get<std::vector<std::vector<std::int64_t>>>() == c.pack_lengths);
      const auto cu = b.packed->cu_seqlens().to(at::kLong);
      CHECK(j.at("max_length").get<std::int64_t>() == (cu.slice(0, 1) - cu.slice(0, 0, -1)).max().item<std::int64_t>());
    }
    INFO(set);
    CHECK(packed >= 1);
    CHECK(packed_grpo >= 1);
    if (set == "ci") CHECK((packed == 2 && packed_grpo == 1));
  }
  CHECK((straddles && single && ragged && micro_packs));
  CHECK((grpo_straddles && grpo_single_token_completion && grpo_micro_packs));
  // The survey's packed case suits the two recalled bugs: every target but each sequence's first (TRL PR #4170) and
  // a micro-batch of two packs with different boundaries (Liger PR #477), fp32.
  const auto survey = sbp::conform_cases("survey");
  const auto it = std::find_if(survey.begin(), survey.end(), [](const auto& c) { return !c.pack_lengths.empty(); });
  REQUIRE(it != survey.end());
  CHECK(it->dtype == c10::kFloat);
  CHECK(it->batch.prompt_fraction == 0);
  const auto b = sbp::conform_batch(*it, *sbp::make_objective(it->objective));
  CHECK(b.field("labels").ne(-100).sum().item<std::int64_t>() == b.batch_size() * b.seq_len() - b.packed->sequences());
}

TEST_CASE("a case file's pack_lengths are checked and named", "[conform][packed]") {
  const auto file = std::filesystem::temp_directory_path() / "streambp-test-packed-cases.json";
  const auto cases = [&](const std::string& text) {
    std::ofstream(file) << text;
    return sbp::conform_cases(file.string());
  };
  const auto ok = cases(R"([{"name": "p", "pack_lengths": [[3, 5], [2, 1]]}])");
  REQUIRE(ok.size() == 1);
  CHECK(ok[0].batch.batch_size == 2);
  CHECK(ok[0].batch.seq_len == 8);
  CHECK_THROWS_WITH(cases(R"([{"name": "p", "seq": 6, "pack_lengths": [[3, 5]]}])"),
                    Catch::Contains("pack_lengths[0]: 8 tokens do not fit T = 6"));
  CHECK_THROWS_WITH(cases(R"([{"name": "p", "pack_lengths": [[3, 0]]}])"),
                    Catch::Contains("pack_lengths[0][1]: length 0"));
  CHECK_THROWS_WITH(cases(R"([{"name": "p", "objective": "dpo", "pack_lengths": [[3], [3]]}])"),
                    Catch::Contains("packed rows are SFT or GRPO (DPO refuses packed rows"));
  const auto grpo = cases(R"([{"name": "p", "objective": "grpo:loss_type=grpo", "group": 2, "pack_lengths": [[3, 5], [6, 2]]}])");
  REQUIRE(grpo.size() == 1);
  CHECK(grpo[0].batch.seq_len == 8);
  CHECK_THROWS_WITH(cases(R"([{"name": "p", "objective": "grpo", "pack_lengths": [[3, 5], [2, 1]]}])"),
                    Catch::Contains("pack_lengths[1]: 3 tokens for T = 8: a packed GRPO row is full"));
  CHECK_THROWS_WITH(cases(R"([{"name": "p", "batch": 3, "pack_lengths": [[3], [3]]}])"),
                    Catch::Contains("pack_lengths has 2 rows, batch says 3"));
  std::filesystem::remove(file);
}

// The oracle of a packed GRPO case (issue #59): the harness's fp64 standard BP on the packed batch, as conform writes
// and judges it (its log-probs completed as `conform` completes them), equals standard BP on the same completions one
// per right-padded row (padded_sequences: the first oracle of every packed step, test_packed_grpo.cpp's gate), loss
// and every tensor.
TEST_CASE("a packed GRPO case's oracle is the padded completions' gradient", "[conform][packed]") {
  int checked = 0;
  std::set<std::string> seen;
  for (const auto* set : {"quick", "full", "survey"})
    for (const auto& c : sbp::conform_cases(set)) {
      if (c.pack_lengths.empty() || c.objective.rfind("grpo", 0) != 0 || !seen.insert(c.name).second) continue;
      INFO(set << ": " << c.name);
      REQUIRE(c.dtype == c10::kDouble);
      sbp::Model model(c.config, c.dtype, c.batch.seed);
      if (!c.lora.empty()) model.add_lora(sbp::parse_lora_spec(c.lora), c.batch.seed + 1);
      const auto objective = sbp::make_objective(c.objective);
      auto batch = sbp::conform_batch(c, *objective);
      sbp::complete_batch(model, *objective, batch, "random batch", true, "", c.dtype, c.batch.seed);
      const auto packed = sbp::test::run_step(model, "standard", *objective, batch);
      const auto padded = sbp::test::run_step(model, "standard", *objective, sbp::padded_sequences(batch));
      CHECK(std::abs(packed.loss - padded.loss) <= 1e-12 * std::abs(padded.loss));
      const auto cmp = sbp::compare_gradients(padded.gradients, packed.gradients);
      INFO((cmp.worst() ? cmp.worst()->name : std::string()) << " " << (cmp.worst() ? cmp.worst()->normwise_rel : 0.0));
      CHECK(cmp.passed(1e-10));
      ++checked;
    }
  CHECK(checked == 4);  // quick's two, full's LoRA dr_grpo, the survey's T = 300
}
