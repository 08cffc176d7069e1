// Sequence parallelism's attention is exact (issue #32, ARCHITECTURE.md §16): N ranks (threads of this process, each
// with its own Gloo group over a FileStore) each hold a zig-zag shard of the sequence, all-gather the K/V, attend their
// queries and reduce-scatter the K/V gradients; the output and every gradient at each rank's positions equal one
// process's causal attention over the whole sequence, fp64, to 1e-12. Negative controls: a reduce-scatter that keeps
// only this rank's own share, and a split that assumes T divides by N (DeepSpeed #7384's silent truncation).
#include <catch2/catch.hpp>

#include <filesystem>
#include <functional>
#include <random>
#include <set>

#include <ATen/ATen.h>

#include "baselines/methods.h"
#include "core/model/context_attention.h"
#include "core/model/lora.h"
#include "core/model/model.h"
#include "core/model/sequence_shard.h"
#include "core/objectives/sft.h"
#include "core/training/sequence_parallel.h"
#include "tests/support/gloo_ranks.h"
#include "tests/support/test_support.h"
#include "verify/grad_compare.h"

namespace {

using sbp::test::run_gloo_ranks;

double relative(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).norm().item<double>() / std::max(b.norm().item<double>(), 1e-300);
}

// Faults in the exchange, for the negative controls: the backward keeps this rank's own share of the K/V gradients at
// its positions instead of the group's SUM (a missing reduction), or an objective's row statistics stay this rank's
// (a missing group-wide statistics pass). The collectives still run: the other ranks wait for them.
class FaultyExchange final : public sbp::KVExchange {
 public:
  FaultyExchange(sbp::SequenceParallel& inner, bool local_kv, bool local_statistics)
      : inner_(inner), local_kv_(local_kv), local_statistics_(local_statistics) {}
  const sbp::SequenceShard& shard() const override { return inner_.shard(); }
  at::Tensor gather(const at::Tensor& local) override { return inner_.gather(local); }
  at::Tensor scatter_sum(const at::Tensor& whole) override {
    auto summed = inner_.scatter_sum(whole);
    if (!local_kv_) return summed;
    std::vector<at::Tensor> parts;
    for (const auto& b : shard().blocks) parts.push_back(whole.narrow(-2, b.start, b.length()));
    return at::cat(parts, -2);
  }
  void sum_over_group(at::Tensor& values) override {
    auto copy = values.clone();
    inner_.sum_over_group(copy);
    if (!local_statistics_) values.copy_(copy);
  }

 private:
  sbp::SequenceParallel& inner_;
  bool local_kv_, local_statistics_;
};

struct Shape {
  std::int64_t T, heads, kv_heads;
};

// DeepSpeed #7384's split, for a negative control: T / N contiguous positions per rank, the last T mod N dropped
// (each rank believes the sequence is N * (T / N) long).
std::vector<sbp::SequenceShard> truncating_split(std::int64_t T, int world) {
  const auto each = T / world;
  std::vector<sbp::SequenceShard> out;
  for (int r = 0; r < world; ++r) out.push_back({r, world, each * world, {{r * each, (r + 1) * each}}});
  return out;
}

// The worst relative error, over ranks and tensors, of sharded attention against the whole sequence's.
double sharded_attention_error(int world, const Shape& shape, bool local_only = false, bool truncating = false) {
  const std::int64_t B = 2, hd = 8;
  const double scale = 1.0 / std::sqrt(double(hd));
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  at::manual_seed(7);
  const auto q = at::randn({B, shape.heads, shape.T, hd}, opts), k = at::randn({B, shape.kv_heads, shape.T, hd}, opts),
             v = at::randn({B, shape.kv_heads, shape.T, hd}, opts), w = at::randn({B, shape.heads, shape.T, hd}, opts);
  // One process over the whole sequence.
  const auto qr = q.clone().requires_grad_(), kr = k.clone().requires_grad_(), vr = v.clone().requires_grad_();
  const auto ref = at::scaled_dot_product_attention(qr, kr, vr, {}, 0.0, true, scale, /*enable_gqa=*/true);
  (ref * w).sum().backward();
  std::vector<double> worst(world, 0.0);
  run_gloo_ranks(world, [&](sbp::Communicator& comm) {
    sbp::SequenceParallel sp = truncating ? sbp::SequenceParallel(comm, truncating_split(shape.T, world))
                                          : sbp::SequenceParallel(comm, shape.T);
    FaultyExchange faulty(sp, /*local_kv=*/true, /*local_statistics=*/false);
    sbp::KVExchange& exchange = local_only ? static_cast<sbp::KVExchange&>(faulty) : sp;
    const auto& shard = sp.shard();
    const auto index = at::tensor(shard.positions(), at::kLong);
    const auto take = [&](const at::Tensor& t) { return t.index_select(2, index); };
    const auto ql = take(q).requires_grad_(), kl = take(k).requires_grad_(), vl = take(v).requires_grad_();
    const auto kv = sbp::gather_sequence(exchange, at::stack({kl, vl}));  // K and V in one exchange
    const auto o = sbp::shard_attention(ql, kv[0], kv[1], shard, {scale});
    (o * take(w)).sum().backward();
    double e = relative(o.detach(), take(ref.detach()));
    e = std::max(e, relative(ql.grad(), take(qr.grad())));
    e = std::max(e, relative(kl.grad(), take(kr.grad())));
    e = std::max(e, relative(vl.grad(), take(vr.grad())));
    worst[comm.rank()] = e;
  });
  return *std::max_element(worst.begin(), worst.end());
}

}  // namespace

TEST_CASE("the zig-zag split tiles the sequence once, balances the causal work, and needs a position per rank",
          "[sequence-parallel]") {
  for (const int world : {1, 2, 3, 4, 8})
    for (const std::int64_t T : {std::int64_t(world), std::int64_t(2 * world - 1), std::int64_t(37),
                                 std::int64_t(48), std::int64_t(1000003)}) {
      if (T < world) continue;
      std::set<std::int64_t> seen;
      std::int64_t most = 0, least = INT64_MAX, total = 0, repeated = 0;
      for (const auto& s : sbp::zigzag_shards(T, world)) {
        CHECK(s.length() >= 1);
        for (const auto p : s.positions()) repeated += seen.insert(p).second ? 0 : 1;
        most = std::max(most, s.causal_pairs());
        least = std::min(least, s.causal_pairs());
        total += s.causal_pairs();
      }
      INFO("T " << T << " over " << world << " ranks");
      CHECK(repeated == 0);
      CHECK(std::int64_t(seen.size()) == T);
      CHECK(*seen.begin() == 0);
      CHECK(*seen.rbegin() == T - 1);
      CHECK(total == T * (T + 1) / 2);
      // Balanced: parts differ by at most one position, so two parts' causal work by at most about 2T pairs.
      CHECK(most - least <= 2 * T + 2);
    }
  CHECK_THROWS_WITH(sbp::zigzag_shard(3, 0, 4), Catch::Contains("3 positions over 4 ranks"));
}

TEST_CASE("attention over a zig-zag-sharded sequence (K/V all-gathered, their gradients reduce-scattered) equals the "
          "whole sequence's in fp64: N = 2, 3, 4, GQA with fewer KV heads than ranks and MHA, T not divisible",
          "[sequence-parallel][distributed]") {
  double worst = 0;
  for (const int world : {2, 3, 4})
    for (const auto& shape : {Shape{37, 4, 1}, Shape{48, 4, 2}, Shape{29, 3, 3}}) {
      const auto e = sharded_attention_error(world, shape);
      INFO(world << " ranks, T " << shape.T << ", heads " << shape.heads << "x" << shape.kv_heads << ": " << e);
      CHECK(e <= 1e-12);
      worst = std::max(worst, e);
    }
  WARN("sharded attention: largest relative difference " << worst);
}

TEST_CASE("negative controls: a K/V gradient kept per rank instead of summed over the group, and a split that assumes "
          "T divides by N, fail the sequence-parallel gate", "[sequence-parallel][distributed][negative-control]") {
  CHECK(sharded_attention_error(2, {37, 4, 1}, /*local_only=*/true) > 1e-3);
  // The truncating split's forward matches at the positions it keeps; the K/V gradients miss the dropped queries'.
  CHECK(sharded_attention_error(4, {37, 4, 1}, false, /*truncating=*/true) > 1e-3);
  CHECK(sharded_attention_error(4, {36, 4, 1}, false, /*truncating=*/true) <= 1e-12);  // T divisible: no fault
}

TEST_CASE("one layer's exchange moves what the formula says: an all-gather per piece of the rows' K and V, a "
          "reduce-scatter per piece of their gradients, bytes of the longest shard", "[sequence-parallel][distributed]") {
  for (const int world : {2, 3}) {
    const std::int64_t T = 37, B = 2, kv = 1, hd = 8;
    std::vector<std::map<std::string, sbp::CollectiveStats>> stats(world);
    run_gloo_ranks(world, [&](sbp::Communicator& comm) {
      sbp::SequenceParallel sp(comm, T);
      const auto opts = at::TensorOptions().dtype(at::kDouble);
      const auto local = at::randn({2, B, kv, sp.shard().length(), hd}, opts).requires_grad_();
      comm.reset_stats();
      sbp::gather_sequence(sp, local).sum().backward();
      stats[comm.rank()] = comm.stats();
    });
    const auto expected = sbp::exchange_cost(T, world, 2 * B * kv, hd * 8);
    CHECK(expected.calls == 4);  // 2 x 2 x 1 slices, at most 4 pieces
    for (const auto& s : stats) {
      CHECK(s.at("all_gather").calls == expected.calls);
      CHECK(s.at("all_gather").bytes == expected.all_gather_bytes);
      CHECK(s.at("reduce_scatter").calls == expected.calls);
      CHECK(s.at("reduce_scatter").bytes == expected.reduce_scatter_bytes);
      CHECK(s.size() == 2);
    }
  }
}

namespace {

// What each rank's copy of the batch gets wrong, for the negative controls.
enum class Fault {
  none,
  // Labels shifted after the split (DeepSpeed PR #8587's kind of slip): a rank sees only its shard's tokens, so the
  // last position of each of its blocks has no target (its target is the next block's first token).
  shift_after_split,
  // A per-rank mean: each rank normalises by its own shard's target count instead of the whole sequence's.
  per_rank_normaliser,
  // A row term's statistics (DPO's log-prob sums, GRPO's sequence log-ratio) of this rank's positions only.
  rank_statistics,
};

struct ModelCase {
  std::int64_t T, kv_heads;
  std::string lora;  // "": full fine-tuning
  std::string method = "standard";
  std::string objective = "sft";  // SFT, GRPO (token or sequence importance), DPO
};

// The method on `world` ranks, each on its zig-zag shard of every row (the global batch on every rank: the objective
// prepared on the whole sequence), the loss and gradients summed over the group; against one process. The largest
// relative difference (loss, every gradient normwise).
double sequence_parallel_error(int world, const ModelCase& c, Fault fault = Fault::none) {
  auto config = sbp::test::tiny_config();
  config.num_key_value_heads = c.kv_heads;
  const auto make_model = [&] {
    auto m = std::make_unique<sbp::Model>(config, at::kDouble, 91);
    if (!c.lora.empty()) m->add_lora(sbp::parse_lora_spec(c.lora), 93);
    return m;
  };
  // Right padding and masked prompts (GRPO: prompts and completions of drawn lengths): rows with different target
  // counts.
  auto reference_model = make_model();
  auto reference_objective = sbp::make_objective(c.objective);
  const auto batch = c.objective == "sft" ? sbp::random_sft_batch(config, {2, c.T, 0.2, 0.25, 92})
                                          : sbp::test::objective_batch(*reference_model, *reference_objective,
                                                                       {2, c.T, 0.2, 0.0, 92});
  const auto reference = sbp::test::run_step(*reference_model, "standard", *reference_objective, batch);
  std::vector<double> errors(world, 0.0);
  run_gloo_ranks(world, [&](sbp::Communicator& comm) {
    auto model = make_model();
    sbp::SequenceParallel sp(comm, c.T);
    FaultyExchange faulty(sp, /*local_kv=*/false, /*local_statistics=*/true);
    model->set_kv_source(fault == Fault::rank_statistics ? static_cast<sbp::KVExchange*>(&faulty) : &sp);
    auto local = batch;
    auto& labels = local.fields[c.objective == "sft" ? "labels" : "completion_mask"];  // the label faults are SFT's
    if (fault == Fault::shift_after_split || fault == Fault::per_rank_normaliser) labels = labels.clone();
    if (fault == Fault::shift_after_split)
      for (const auto& b : sp.shard().blocks)
        if (b.end < c.T) labels.select(1, b.end).fill_(-100);
    if (fault == Fault::per_rank_normaliser) {
      auto mine = at::zeros({c.T}, at::kBool);
      for (const auto p : sp.shard().positions())
        if (p + 1 < c.T) mine[p + 1] = true;  // the tokens this rank's positions predict
      labels.masked_fill_(~mine.unsqueeze(0).expand_as(labels), -100);
    }
    auto objective = sbp::make_objective(c.objective);
    errors[comm.rank()] =
        sbp::test::group_sum_error(comm, sbp::test::run_step(*model, c.method, *objective, local), reference);
  });
  return *std::max_element(errors.begin(), errors.end());
}

}  // namespace

TEST_CASE("standard BP, checkpointing and StreamBP over a sequence split on N ranks, their gradients summed over the "
          "group, equal one process of standard BP over the whole sequence in fp64: N = 2, 3, 4, GQA with fewer KV "
          "heads than ranks and MHA, T not divisible, padded rows and masked prompts, full and LoRA, SFT, GRPO (token "
          "and sequence importance) and DPO (row statistics summed over the group)",
          "[sequence-parallel][distributed]") {
  double worst = 0;
  // StreamBP: chunks inside the shard's blocks (a block of T = 37 over 4 ranks has 4-5 positions), several per block
  // and one per block. Every method on 3 ranks; on 2 and 4 the StreamBP with several chunks per block.
  for (const std::string method : {"standard", "checkpoint", "streambp:layer_chunk=2,head_chunk=3",
                                   "streambp:layer_chunk=64,head_chunk=64"})
    for (const int world : {2, 3, 4}) {
      if (world != 3 && method != "streambp:layer_chunk=2,head_chunk=3") continue;
      for (const auto& c : {ModelCase{37, 1, "", method}, ModelCase{37, 4, "", method},
                            ModelCase{48, 2, "rank=8", method}, ModelCase{41, 2, "", method, "grpo"},
                            ModelCase{41, 2, "rank=8", method, "grpo"},
                            ModelCase{41, 1, "", method, "grpo:importance=sequence"},
                            ModelCase{43, 2, "", method, "dpo"}, ModelCase{43, 2, "rank=8", method, "dpo"}}) {
        const auto e = sequence_parallel_error(world, c);
        INFO(method << " on " << world << " ranks, " << c.objective << ", T " << c.T << ", KV heads " << c.kv_heads
                    << ", lora '" << c.lora << "': " << e);
        CHECK(e <= 1e-12);
        worst = std::max(worst, e);
      }
    }
  WARN("sequence-parallel SFT, GRPO and DPO: largest relative difference " << worst);
}

TEST_CASE("a method that cannot run on a sequence shard is refused, not silently wrong",
          "[sequence-parallel][distributed]") {
  auto config = sbp::test::tiny_config();
  const auto batch = sbp::random_sft_batch(config, {1, 16, 0.0, 0.0, 92});
  run_gloo_ranks(1, [&](sbp::Communicator& comm) {
    sbp::Model model(config, at::kDouble, 91);
    sbp::SequenceParallel sp(comm, 16);
    model.set_kv_source(&sp);
    for (const auto& spec : sbp::metered_method_specs())
      if (!sbp::make_method(spec)->runs_sequence_shards())
        CHECK_THROWS_WITH(sbp::test::run_step(model, spec, batch), Catch::Contains("sequence-parallel"));
  });
}

TEST_CASE("negative controls: labels shifted after the split, a per-rank normaliser and row statistics of a rank's "
          "own positions fail the sequence-parallel gate",
          "[sequence-parallel][distributed][negative-control]") {
  const double shifted = sequence_parallel_error(2, {37, 1, ""}, Fault::shift_after_split);
  const double per_rank = sequence_parallel_error(2, {37, 1, ""}, Fault::per_rank_normaliser);
  WARN("shift after the split: " << shifted << "; per-rank normaliser: " << per_rank);
  CHECK(shifted > 1e-3);
  CHECK(per_rank > 1e-3);
  // The row statistics of a rank's own positions: wrong coefficients on every rank, for StreamBP's streamed head too.
  for (const std::string method : {"standard", "streambp:layer_chunk=4,head_chunk=4"})
    for (const std::string objective : {"dpo", "grpo:importance=sequence"}) {
      const double rank_statistics = sequence_parallel_error(2, {43, 2, "", method, objective}, Fault::rank_statistics);
      INFO(method << ", " << objective << ": " << rank_statistics);
      CHECK(rank_statistics > 1e-3);
    }
}
