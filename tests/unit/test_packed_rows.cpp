// Packed rows as a batch carries them (ARCHITECTURE.md §3 "Packed rows"): the two spellings of the boundaries derive
// each other, every malformed boundary is bad input naming the row and the position, and the objectives either score a
// packed row as HF does (SFT) or refuse it saying why (GRPO, DPO).
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include "core/model/packed_rows.h"
#include "core/objectives/batch.h"
#include "core/objectives/length_distribution.h"
#include "core/objectives/objective.h"
#include "core/objectives/packed_batch.h"
#include "core/objectives/sft.h"
#include "tests/support/test_support.h"

using sbp::InputError;
using sbp::PackedRows;

namespace {

at::Tensor ids(std::vector<std::vector<std::int64_t>> rows) {
  auto out = at::empty({std::int64_t(rows.size()), std::int64_t(rows[0].size())}, at::kLong);
  for (std::size_t b = 0; b < rows.size(); ++b)
    for (std::size_t t = 0; t < rows[b].size(); ++t) out[std::int64_t(b)][std::int64_t(t)] = rows[b][t];
  return out;
}

at::Tensor cu(std::vector<std::int32_t> values) { return at::tensor(values, at::kInt); }

// A packed SFT batch of the tiny preset: rows [5 | 1 | 6] and [3 | 9] (T = 12).
sbp::Batch small_packed_batch() {
  return sbp::packed_sft_batch(sbp::test::tiny_config(), {{5, 1, 6}, {3, 9}}, 0.0, 3);
}

}  // namespace

TEST_CASE("position_ids and cu_seqlens derive each other", "[packed]") {
  const auto from_ids = PackedRows::from_position_ids(ids({{0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5},
                                                           {0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8}}), "test");
  CHECK(from_ids->starts(0) == std::vector<std::int64_t>{0, 5, 6});
  CHECK(from_ids->starts(1) == std::vector<std::int64_t>{0, 3});
  CHECK(from_ids->sequences() == 5);
  // cu_seqlens over the flattened 2 x 12 tokens, as flash-attention's varlen kernels and HF's cu_seq_lens_q take them.
  CHECK(from_ids->cu_seqlens().equal(cu({0, 5, 6, 12, 15, 24})));
  const auto from_cu = PackedRows::from_cu_seqlens(cu({0, 5, 6, 12, 15, 24}), 2, 12, "test");
  CHECK(from_cu->position_ids().equal(from_ids->position_ids()));
  CHECK(from_ids->sequence_start(0, 5) == 5);
  CHECK(from_ids->sequence_end(0, 7) == 12);

  // A batch given both spellings checks that they agree.
  auto batch = small_packed_batch();
  const auto rows = batch.packed;
  sbp::set_sequence_boundaries(batch, rows->position_ids(), rows->cu_seqlens(), "both");
  CHECK(batch.packed->starts(0) == rows->starts(0));
  auto other = rows->cu_seqlens().clone();
  other[1] = 4;  // row 0's second sequence starts at 4 here, at 5 in position_ids
  CHECK_THROWS_WITH(sbp::set_sequence_boundaries(batch, rows->position_ids(), other, "both"),
                    Catch::Contains("disagree in row 0 at position 4"));
}

TEST_CASE("a chunk of queries is cut where its sequences start, and rows move with their boundaries", "[packed]") {
  const auto rows = PackedRows::from_lengths({{5, 1, 6}, {3, 9}}, 12);
  // Queries [4, 8) of row 0: the tail of the first sequence (which starts at 0), all of the second, the third's head.
  const auto runs = rows->runs(0, 4, 8);
  REQUIRE(runs.size() == 3);
  CHECK((runs[0].begin == 4 && runs[0].end == 5 && runs[0].sequence_start == 0));
  CHECK((runs[1].begin == 5 && runs[1].end == 6 && runs[1].sequence_start == 5));
  CHECK((runs[2].begin == 6 && runs[2].end == 8 && runs[2].sequence_start == 6));
  CHECK(rows->positions(4, 8).equal(ids({{4, 0, 0, 1}, {1, 2, 3, 4}})));

  const auto batch = small_packed_batch();
  const auto swapped = batch.select_rows(at::tensor(std::vector<std::int64_t>{1, 0}, at::kLong));
  REQUIRE(swapped.packed);
  CHECK(swapped.packed->starts(0) == batch.packed->starts(1));
  CHECK(swapped.packed->starts(1) == batch.packed->starts(0));
  CHECK(batch.to(at::kCPU).packed == batch.packed);
}

TEST_CASE("malformed boundaries are bad input naming the row and the position", "[packed]") {
  // position_ids that do not count 0, 1, 2, ... within a sequence.
  CHECK_THROWS_AS(PackedRows::from_position_ids(ids({{0, 1, 3, 4}}), "f"), InputError);
  CHECK_THROWS_WITH(PackedRows::from_position_ids(ids({{0, 1, 2, 3}, {0, 1, 3, 4}}), "f"),
                    Catch::Contains("row 1, position 2 is 3 after 1"));
  CHECK_THROWS_WITH(PackedRows::from_position_ids(ids({{1, 2, 3, 4}}), "f"), Catch::Contains("row 0, position 0 is 1"));
  CHECK_THROWS_WITH(PackedRows::from_position_ids(ids({{0, 1, 1, 2}}), "f"), Catch::Contains("row 0, position 2 is 1 after 1"));
  CHECK_THROWS_WITH(PackedRows::from_position_ids(at::zeros({2, 3}, at::kFloat), "f"), Catch::Contains("integer"));
  // cu_seqlens (2 rows of 4): an empty sequence, past B*T, a sequence across a row's end, not from 0, short of B*T.
  CHECK_THROWS_WITH(PackedRows::from_cu_seqlens(cu({0, 2, 2, 4, 8}), 2, 4, "f"),
                    Catch::Contains("cu_seqlens[2] = 2 after 2") && Catch::Contains("row 0, position 2") &&
                        Catch::Contains("empty"));
  CHECK_THROWS_WITH(PackedRows::from_cu_seqlens(cu({0, 4, 9}), 2, 4, "f"),
                    Catch::Contains("cu_seqlens[2] = 9 is past the batch's 8 tokens") && Catch::Contains("row 1, position 0"));
  CHECK_THROWS_WITH(PackedRows::from_cu_seqlens(cu({0, 3, 6, 8}), 2, 4, "f"),
                    Catch::Contains("cu_seqlens[2] = 6") && Catch::Contains("from row 0, position 3 runs past the end of its row"));
  CHECK_THROWS_WITH(PackedRows::from_cu_seqlens(cu({1, 4, 8}), 2, 4, "f"), Catch::Contains("cu_seqlens[0] is 1"));
  CHECK_THROWS_WITH(PackedRows::from_cu_seqlens(cu({0, 4, 7}), 2, 4, "f"), Catch::Contains("ends at 7, before the batch's 8"));

  // A label across a boundary: the last token of row 1's first sequence would predict the next one's first.
  auto batch = small_packed_batch();
  sbp::validate_tokens(batch, sbp::test::tiny_config(), "packed");
  sbp::SftObjective sft;
  CHECK_NOTHROW(sft.prepare(batch, sbp::test::tiny_config()));
  batch.fields["labels"] = batch.fields["labels"].clone();
  batch.fields["labels"][1][3] = 7;
  CHECK_THROWS_WITH(sft.prepare(batch, sbp::test::tiny_config(), std::nullopt, "packed.safetensors"),
                    Catch::Contains("packed.safetensors: row 1, position 3: labels there is a target across a sequence boundary"));
}

TEST_CASE("SFT scores a packed row as its sequences padded, and DPO refuses packed rows saying why", "[packed]") {
  const auto config = sbp::test::tiny_config();
  const auto batch = small_packed_batch();
  const auto padded = sbp::padded_sequences(batch);
  CHECK(padded.input_ids.sizes() == at::IntArrayRef({5, 9}));  // five sequences, the longest 9 tokens
  sbp::validate_tokens(padded, config, "padded");
  sbp::SftObjective sft;
  // The normaliser is the step's target count: the same scored tokens, packed or padded.
  CHECK(sft.prepare(batch, config).batch_totals().tokens == sft.prepare(padded, config).batch_totals().tokens);
  CHECK(sft.prepare(batch, config).batch_totals().tokens == 2 * 12 - 5);  // a sequence of L tokens has L - 1 targets

  // DPO's pairs would have to be matched across packs (GRPO takes packed rows: test_packed_grpo.cpp).
  const auto dpo = sbp::make_objective("dpo");
  auto made = dpo->random_batch(config, {4, 12, 0.0, 0.0, 5, 2});
  made.packed = PackedRows::from_lengths({{6, 6}, {6, 6}, {6, 6}, {6, 6}}, 12);
  CHECK_THROWS_WITH(dpo->prepare(made, config),
                    Catch::Contains("dpo: packed rows") && Catch::Contains("matched across packs"));
  sbp::RandomBatchOptions packed_random{4, 12, 0.0, 0.0, 5, 2};
  packed_random.pack = sbp::LengthDistribution::parse("fixed:length=6");
  CHECK_THROWS_AS(dpo->random_batch(config, packed_random), InputError);
}

TEST_CASE("the length distributions of --pack fill every row exactly", "[packed]") {
  for (const std::string spec : {"uniform:min=1,max=9", "lognormal:median=6,sigma=1.5", "fixed:length=5"}) {
    const auto d = sbp::LengthDistribution::parse(spec);
    CHECK(sbp::LengthDistribution::parse(d.spec()).spec() == d.spec());
    const auto rows = d.draw(3, 40, 7);
    REQUIRE(rows.size() == 3);
    for (const auto& row : rows) {
      std::int64_t sum = 0;
      for (const auto L : row) {
        CHECK(L >= 1);
        sum += L;
      }
      CHECK(sum == 40);
    }
    CHECK(d.draw(3, 40, 7) == rows);  // seeded
  }
  CHECK_THROWS_WITH(sbp::LengthDistribution::parse("zipf:s=1"), Catch::Contains("unknown length distribution 'zipf'"));
  CHECK_THROWS_WITH(sbp::LengthDistribution::parse("uniform:min=9,max=3"), Catch::Contains("max=3 is below min=9"));
  CHECK_THROWS_WITH(sbp::LengthDistribution::parse("uniform:min=2"), Catch::Contains("needs max"));
  CHECK_THROWS_WITH(sbp::LengthDistribution::parse("fixed:length=0"), Catch::Contains("length=0"));
}
