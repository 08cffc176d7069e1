// Packed rows under sequence parallelism are exact (issue #59 item 4, ARCHITECTURE.md §16 "Packed rows"): a sequence
// may straddle ranks and a rank may hold the tails of several; under the all-gather and the ring, every method that
// runs on a shard, its gradients summed over the group, equals one process over the whole packed batch in fp64 to
// 1e-12. The ring skips the parts of a block that no query of a chunk's row can see, and what it computed and skipped
// is counted against a brute force over every (query, key) pair. Negative controls: a rank that attends across the
// boundary of a sequence begun on another rank, and a rank that restarts positions at its own first position.
#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "baselines/methods.h"
#include "core/io/spec.h"
#include "core/methods/method.h"
#include "core/model/lora.h"
#include "core/model/model.h"
#include "core/model/packed_rows.h"
#include "core/model/sequence_shard.h"
#include "core/objectives/packed_batch.h"
#include "core/objectives/sft.h"
#include "core/training/ring_blocks.h"
#include "core/training/ring_exchange.h"
#include "core/training/sequence_parallel.h"
#include "core/training/sequence_scheme.h"
#include "tests/support/faulty_packing.h"
#include "tests/support/gloo_ranks.h"
#include "tests/support/test_support.h"
#include "verify/grad_compare.h"

namespace {

using sbp::RingBlockCounts;
using sbp::SequenceScheme;

constexpr std::int64_t kPackedSpT = 48;
// Two rows of 48. Over 2 ranks (zig-zag parts of 12: rank 0 [0, 12) + [36, 48), rank 1 [12, 24) + [24, 36)): row 0's
// [8, 28) begins on rank 0 and goes on over both of rank 1's parts, [28, 40) begins on rank 1 and ends on rank 0, whose
// second part holds its tail beside [40, 48); a sequence of one token at 7; row 1's [0, 30) spans every rank, and
// [32, 48) begins on rank 1 and ends on rank 0. Over 3 ranks (parts of 8) [8, 28) and [0, 30) cross all three, and
// row 0's boundary at 40 falls on a part's first position.
const std::vector<std::vector<std::int64_t>> kPackedSpLengths = {{7, 1, 20, 12, 8}, {30, 2, 16}};

// The models: the tiny preset (GQA, qk_norm, tied), its untied MHA corner with every bias, and the tiny preset under
// LoRA (the adapters' gradients summed over the group).
enum class PackedSpModel { tiny, untied_mha_with_biases, tiny_lora };

std::unique_ptr<sbp::Model> packed_sp_model(PackedSpModel kind) {
  auto model = std::make_unique<sbp::Model>(
      kind == PackedSpModel::untied_mha_with_biases ? sbp::test::untied_mha_with_biases() : sbp::test::tiny_config(),
      at::kDouble, 61);
  if (kind == PackedSpModel::tiny_lora) model->add_lora(sbp::parse_lora_spec("rank=8"), 63);
  return model;
}

// The packed SFT batch (masked prompts) and one process's standard BP over it: the oracle.
struct PackedSpOracle {
  explicit PackedSpOracle(PackedSpModel kind) : model(packed_sp_model(kind)) {
    sbp::SftObjective sft;
    reference = sbp::test::run_step(*model, "standard", sft, batch);
  }
  std::unique_ptr<sbp::Model> model;
  sbp::Batch batch = sbp::packed_sft_batch(model->config(), kPackedSpLengths, 0.25, 62);
  sbp::test::StepGradients reference;
};
const PackedSpOracle& packed_sp_oracle(PackedSpModel kind = PackedSpModel::tiny) {
  static std::map<PackedSpModel, std::unique_ptr<PackedSpOracle>> oracles;
  auto& oracle = oracles[kind];
  if (!oracle) oracle = std::make_unique<PackedSpOracle>(kind);
  return *oracle;
}

enum class PackedSpFault {
  none,
  // Rank 0 ignores the start (28) of row 0's sequence [28, 40), which begins on rank 1: its queries at 36-39 attend
  // the sequence before it too (LeakyBoundaryRows), RoPE still restarted.
  leaky_boundary,
  // Rank 1 numbers each sequence from its own first position where the sequence began on another rank's part
  // (LocalRestartRows): row 0's [8, 28) at 12 and row 1's [0, 30) at 12 restart at 0.
  local_positions,
};

// What one group step gives: every rank's loss and gradients summed over the group against the oracle, and (ring)
// each rank's block counts.
struct PackedSpRun {
  double loss_error = 0;
  sbp::GradComparison gradients;
  std::vector<RingBlockCounts> counts;
};

PackedSpRun packed_sp_run(int world, SequenceScheme scheme, const std::string& method,
                          PackedSpFault fault = PackedSpFault::none, PackedSpModel kind = PackedSpModel::tiny) {
  const auto& oracle = packed_sp_oracle(kind);
  PackedSpRun out;
  out.counts.resize(std::size_t(world));
  sbp::test::run_gloo_ranks(world, [&](sbp::Communicator& comm) {
    auto model_of_rank = packed_sp_model(kind);
    auto& model = *model_of_rank;
    std::unique_ptr<sbp::KVSource> source;
    sbp::RingExchange* ring = nullptr;
    if (scheme == SequenceScheme::ring) {
      auto r = std::make_unique<sbp::RingExchange>(comm, kPackedSpT);
      ring = r.get();
      source = std::move(r);
    } else {
      source = std::make_unique<sbp::SequenceParallel>(comm, kPackedSpT);
    }
    model.set_kv_source(source.get());
    auto batch = oracle.batch;  // every rank holds the whole batch and its boundaries, at global positions
    if (fault == PackedSpFault::leaky_boundary && comm.rank() == 0)
      batch.packed = std::make_shared<sbp::test::LeakyBoundaryRows>(*oracle.batch.packed, 0, 28);
    if (fault == PackedSpFault::local_positions && comm.rank() == 1) {
      std::vector<std::int64_t> starts;
      for (const auto& b : sbp::zigzag_shard(kPackedSpT, comm.rank(), world).blocks) starts.push_back(b.start);
      batch.packed = std::make_shared<sbp::test::LocalRestartRows>(*oracle.batch.packed, starts);
    }
    sbp::SftObjective sft;
    auto step = sbp::test::run_step(model, method, sft, batch);
    std::vector<at::Tensor> loss = {at::tensor(step.loss, at::kDouble)};
    comm.all_reduce_sum(loss);
    for (auto& g : step.gradients) {
      std::vector<at::Tensor> one = {g.tensor};
      comm.all_reduce_sum(one);
    }
    if (comm.rank() == 0) {
      out.loss_error = std::abs(loss[0].item<double>() - oracle.reference.loss) / std::abs(oracle.reference.loss);
      out.gradients = sbp::compare_gradients(oracle.reference.gradients, step.gradients);
    }
    if (ring) out.counts[std::size_t(comm.rank())] = ring->block_counts();
  });
  return out;
}

std::string packed_sp_text(const PackedSpRun& r) {
  const auto* worst = r.gradients.worst();
  return "loss " + std::to_string(r.loss_error) + ", worst tensor " + (worst ? worst->name : std::string("-")) + " at " +
         std::to_string(r.gradients.max_normwise_rel()) +
         (r.gradients.problems.empty() ? "" : ", problem: " + r.gradients.problems.front());
}

bool packed_sp_passes(const PackedSpRun& r) { return r.loss_error <= 1e-12 && r.gradients.passed(1e-12); }

// The brute force behind the ring's counts: for every query chunk of `rank` (chunks of at most c of its rows: c = 0,
// one per part), row and part of every rank's shard, whether some query of the chunk sees some key of the part (key
// <= query, and on packed rows in the query's sequence), else why not. One ring pass (a forward merge or a backward).
RingBlockCounts packed_sp_brute_force_counts(int world, int rank, std::int64_t c, const sbp::PackedRows* packed) {
  const auto shards = sbp::zigzag_shards(kPackedSpT, world);
  RingBlockCounts counts;
  const std::int64_t B = 2;
  for (const auto& mine : shards[std::size_t(rank)].blocks)
    for (std::int64_t p = mine.start; p < mine.end; p += c ? c : mine.length()) {
      const auto e = std::min(mine.end, p + (c ? c : mine.length()));
      for (std::int64_t b = 0; b < B; ++b)
        for (const auto& owner : shards)
          for (const auto& part : owner.blocks) {
            bool seen = false;
            for (auto q = p; q < e && !seen; ++q)
              for (auto k = part.start; k < part.end && k <= q && !seen; ++k)
                seen = !packed || packed->sequence_start(b, q) == packed->sequence_start(b, k);
            (seen ? counts.computed : part.start >= e ? counts.after_queries : counts.before_sequences) += 1;
          }
    }
  return counts;
}

RingBlockCounts packed_sp_times(const RingBlockCounts& c, std::int64_t n) {
  return {c.computed * n, c.after_queries * n, c.before_sequences * n};
}

RingBlockCounts packed_sp_sum(const RingBlockCounts& a, const RingBlockCounts& b) {
  return {a.computed + b.computed, a.after_queries + b.after_queries, a.before_sequences + b.before_sequences};
}

std::string packed_sp_text(const RingBlockCounts& c) {
  return std::to_string(c.computed) + " computed, " + std::to_string(c.after_queries) + " skipped after the queries, " +
         std::to_string(c.before_sequences) + " skipped before their sequences";
}

// A method's ring passes per layer and step (a forward merge or a backward each): standard BP's forward and backward,
// checkpointing's re-forward besides, StreamBP's forward, then its backward's merge again and its backward.
std::int64_t packed_sp_ring_passes(const std::string& method) {
  return sbp::parse_spec(method).name == "standard" ? 2 : 3;
}
// Its query chunks of the rank's rows: StreamBP's layer chunk; 0 for a graph over the whole shard (one per part).
std::int64_t packed_sp_ring_chunk(const std::string& method) {
  const auto spec = sbp::parse_spec(method);
  return spec.name == "streambp" ? spec.get_int("layer_chunk", 0, 1) : 0;
}

// The ring's counts on every rank of `r` against the brute force: one pass's, times the passes of a step's layers.
// Returns every rank's one pass, summed, with and without the boundaries.
std::pair<RingBlockCounts, RingBlockCounts> packed_sp_check_counts(const PackedSpRun& r, int world,
                                                                   const std::string& method, int layers) {
  const auto* packed = packed_sp_oracle().batch.packed.get();
  const auto chunk = packed_sp_ring_chunk(method);
  RingBlockCounts packed_total, unpacked_total;
  for (int rank = 0; rank < world; ++rank) {
    const auto one_pass = packed_sp_brute_force_counts(world, rank, chunk, packed);
    const auto unpacked = packed_sp_brute_force_counts(world, rank, chunk, nullptr);
    INFO("rank " << rank << ": " << packed_sp_text(r.counts[std::size_t(rank)]) << "; one pass: "
                 << packed_sp_text(one_pass) << " (the same rows unpacked: " << packed_sp_text(unpacked) << ")");
    CHECK(r.counts[std::size_t(rank)] == packed_sp_times(one_pass, packed_sp_ring_passes(method) * layers));
    // Without boundaries only the causal rule skips; with them, what no query's sequence reaches is skipped too.
    CHECK(unpacked.before_sequences == 0);
    CHECK(one_pass.after_queries == unpacked.after_queries);
    CHECK(one_pass.computed + one_pass.before_sequences == unpacked.computed);
    packed_total = packed_sp_sum(packed_total, one_pass);
    unpacked_total = packed_sp_sum(unpacked_total, unpacked);
  }
  CHECK(packed_total.before_sequences > 0);
  return {packed_total, unpacked_total};
}

}  // namespace

TEST_CASE("packed rows with sequences across ranks: every method that runs on a shard, under the all-gather and the "
          "ring, its gradients summed over the group, equals one process in fp64 to 1e-12, and the ring computes exactly "
          "the key blocks some query of a chunk's row sees and skips the rest, per rank as a brute force counts them",
          "[sequence-parallel][distributed][packed][ring]") {
  std::vector<std::string> specs = {"standard"};
  for (const auto& s : sbp::edge_method_specs(kPackedSpT))
    if (sbp::make_method(s)->runs_sequence_shards()) specs.push_back(s);
  const int layers = int(packed_sp_oracle().model->config().num_hidden_layers);
  double worst = 0;
  for (const auto scheme : {SequenceScheme::allgather, SequenceScheme::ring})
    for (const int world : {2, 3}) {
      // Every edge setting on 2 ranks; on 3, chunks inside the parts of 8 and one chunk per part.
      const auto grid = world == 2 ? specs
                                   : std::vector<std::string>{"standard", "checkpoint",
                                                              "streambp:layer_chunk=3,head_chunk=5",
                                                              "streambp:layer_chunk=48,head_chunk=48"};
      for (const auto& method : grid) {
        const auto r = packed_sp_run(world, scheme, method);
        INFO(sbp::sequence_scheme_name(scheme) << ", " << world << " ranks, " << method << ": " << packed_sp_text(r));
        CHECK(r.gradients.problems.empty());
        CHECK(packed_sp_passes(r));
        worst = std::max({worst, r.loss_error, r.gradients.max_normwise_rel()});
        if (scheme != SequenceScheme::ring) continue;
        const auto [packed_total, unpacked_total] = packed_sp_check_counts(r, world, method, layers);
        WARN("ring, " << world << " ranks, " << method << ", one pass of every rank: " << packed_sp_text(packed_total)
                        << "; the same rows unpacked: " << packed_sp_text(unpacked_total));
      }
      // The other corner of the model's flags, and LoRA.
      for (const auto kind : {PackedSpModel::untied_mha_with_biases, PackedSpModel::tiny_lora}) {
        const auto r = packed_sp_run(world, scheme, "streambp:layer_chunk=5,head_chunk=7", PackedSpFault::none, kind);
        INFO(sbp::sequence_scheme_name(scheme) << ", " << world << " ranks, StreamBP, model " << int(kind) << ": "
                                                << packed_sp_text(r));
        CHECK(packed_sp_passes(r));
        worst = std::max({worst, r.loss_error, r.gradients.max_normwise_rel()});
      }
    }
  WARN("packed rows over 2 and 3 ranks, both schemes: largest relative difference " << worst);
}

TEST_CASE("negative controls: a rank that attends across the boundary of a sequence begun on another rank, and a rank "
          "that restarts positions at its own first position, fail the packed sequence-parallel gate under both "
          "schemes, naming a tensor, and the leaking rank also computes key blocks the layout lets it skip",
          "[sequence-parallel][distributed][packed][ring][negative-control]") {
  const auto* packed = packed_sp_oracle().batch.packed.get();
  const int layers = int(packed_sp_oracle().model->config().num_hidden_layers);
  for (const auto scheme : {SequenceScheme::allgather, SequenceScheme::ring})
    for (const std::string method : {"standard", "streambp:layer_chunk=5,head_chunk=7"}) {
      const auto control = packed_sp_run(2, scheme, method);
      const auto leaky = packed_sp_run(2, scheme, method, PackedSpFault::leaky_boundary);
      const auto local = packed_sp_run(2, scheme, method, PackedSpFault::local_positions);
      INFO(sbp::sequence_scheme_name(scheme) << ", " << method << "; control: " << packed_sp_text(control) << "; leaky: "
                                              << packed_sp_text(leaky) << "; local positions: " << packed_sp_text(local));
      CHECK(packed_sp_passes(control));
      CHECK_FALSE(packed_sp_passes(leaky));
      CHECK_FALSE(packed_sp_passes(local));
      // Both change the function, not only its rounding: far above the gate.
      CHECK(leaky.gradients.max_normwise_rel() > 1e-4);
      CHECK(local.gradients.max_normwise_rel() > 1e-4);
      CHECK(leaky.gradients.worst() != nullptr);
      CHECK(local.gradients.worst() != nullptr);
      WARN(sbp::sequence_scheme_name(scheme) << ", " << method << ": leaky boundary " << packed_sp_text(leaky)
                                              << "; local positions " << packed_sp_text(local));
      if (scheme == SequenceScheme::ring) {
        // Rank 0's chunks of [36, 48) read row 0's parts [0, 12) and [12, 24), which the boundary at 28 hides.
        const auto chunk = method == "standard" ? 0 : 5;
        const auto passes_per_layer = method == "standard" ? 2 : 3;
        const auto expected = packed_sp_times(packed_sp_brute_force_counts(2, 0, chunk, packed), passes_per_layer * layers);
        INFO("leaky rank 0: " << packed_sp_text(leaky.counts[0]) << "; the layout's: " << packed_sp_text(expected));
        CHECK(control.counts[0] == expected);
        CHECK(leaky.counts[0].computed > expected.computed);
      }
    }
}

namespace {

// The (run, part) pairs of every rank's chunks of at most c rows (0: one per part) where the ring's key ranges, cut by
// `cut` (query_runs, visible_keys), differ from the keys the rule lets the run's queries see in `truth`: key <= query,
// in the query's sequence.
std::int64_t packed_sp_range_mismatches(int world, std::int64_t T, std::int64_t c, const sbp::PackedRows& cut,
                                        const sbp::PackedRows& truth) {
  std::int64_t wrong = 0;
  const auto shards = sbp::zigzag_shards(T, world);
  for (const auto& mine : shards)
    for (const auto& block : mine.blocks)
      for (auto p = block.start; p < block.end; p += c ? c : block.length()) {
        const sbp::ChunkRows chunk{0, std::min(block.end - p, c ? c : block.length()), p};
        for (const auto& run : sbp::query_runs(chunk, truth.rows(), &cut))
          for (const auto& owner : shards)
            owner.for_each_block([&](const sbp::SequenceShard::Block& part, std::int64_t part_offset) {
              std::set<std::pair<std::int64_t, std::int64_t>> given, allowed;  // (query, key)
              for (const auto& r : sbp::visible_keys(part, part_offset, run)) {
                const auto first = part.start + r.offset - part_offset;
                for (auto k = first; k < first + r.length; ++k)
                  for (auto q = run.begin; q < run.end(); ++q)
                    if (!r.causal || k <= q) given.insert({q, k});
              }
              for (auto q = run.begin; q < run.end(); ++q)
                for (auto k = part.start; k < part.end && k <= q; ++k)
                  if (truth.sequence_start(run.row, k) == truth.sequence_start(run.row, q)) allowed.insert({q, k});
              wrong += given != allowed;
            });
      }
  return wrong;
}

}  // namespace

TEST_CASE("on packed rows the ring's key ranges are exactly the keys each query sees: from its sequence's start to "
          "itself, on every part of every rank's shard, for N = 1-4, T not divisible, chunks of 1 and 3 and one per "
          "part, and ranges cut across one boundary are not", "[sequence-parallel][packed][ring]") {
  std::mt19937 draw(67);
  for (const int world : {1, 2, 3, 4})
    for (const std::int64_t T : {13, 37, 48}) {
      // Two rows of random lengths (1 to T / 3 + 1), the last cut to fit.
      std::vector<std::vector<std::int64_t>> lengths(2);
      for (auto& row : lengths)
        for (std::int64_t left = T; left > 0;) {
          const auto L = std::min<std::int64_t>(left, 1 + std::int64_t(draw() % std::uint32_t(T / 3 + 1)));
          row.push_back(L);
          left -= L;
        }
      const auto packed = sbp::PackedRows::from_lengths(lengths, T);
      for (const std::int64_t c : {1, 3, 0}) {
        INFO(world << " ranks, T " << T << ", chunk " << c);
        CHECK(packed_sp_range_mismatches(world, T, c, *packed, *packed) == 0);
      }
    }
  // The negative control: the runs of rows that leak across row 0's boundary at 28 see keys the rule hides.
  const auto packed = sbp::PackedRows::from_lengths(kPackedSpLengths, kPackedSpT);
  const sbp::test::LeakyBoundaryRows leaky(*packed, 0, 28);
  CHECK(packed_sp_range_mismatches(2, kPackedSpT, 5, leaky, *packed) > 0);
}
