// Data-parallel training is exact (issue #20, ARCHITECTURE.md §12): N ranks over Gloo, each back-propagating its rows of
// every global batch with the gradients reduced once per group at its gradient-ready event (ZeRO 0: all-reduced;
// 1: + optimizer states sharded, slices inside tensors; 2: + gradients reduce-scattered; 3: + parameters sharded,
// gathered at each use), end 5 AdamW steps where
// one process over the global batch ends, in fp64, with unequal target-token counts across ranks (right padding and
// prompt masks differ by row). The ranks are threads of this process, each with its own model, method, objective,
// Trainer and Gloo process group over a FileStore in a fresh temporary directory. The negative controls (the public
// code's bugs and a reduction before a layer's last chunk) are test subclasses and must fail the same check.
#include <catch2/catch.hpp>

#include <chrono>
#include <exception>
#include <filesystem>
#include <functional>
#include <random>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "baselines/methods.h"
#include "core/methods/streaming.h"
#include "core/model/lora.h"
#include "core/model/model.h"
#include "core/training/c10d_communicator.h"
#include "core/training/data_parallel.h"
#include "core/training/sequence_parallel.h"
#include "core/training/trainer.h"
#include "tests/support/faulty_methods.h"
#include "tests/support/test_support.h"
#include "verify/grad_compare.h"

namespace {

using sbp::Batch;

struct Case {
  std::string objective, lora;  // lora "": full fine-tuning
  std::int64_t group = 0;
  std::string preset = "tiny";  // GQA (2 KV heads for 4 query heads); "tiny-mha": as many KV heads as heads
};

struct Result {
  std::vector<double> losses;
  sbp::TensorList params;
  sbp::CollectiveStats all_reduce, all_gather;  // of the last step, rank 0
  std::map<std::string, sbp::CollectiveStats> sequence;  // the sequence-parallel group's, of the last step, rank 0
  std::int64_t resident = 0;  // trainable elements present after the steps (ZeRO-3: none, until gathered)
};

constexpr int kSteps = 5;
constexpr std::int64_t kRows = 24, kSeq = 21;  // 24 rows split over 2, 3 and 4 ranks (DPO: 12 pairs)

sbp::TrainOptions options() {
  sbp::TrainOptions o;
  o.optimizer = sbp::parse_optimizer_spec("adamw:lr=2e-3,weight_decay=0.1");
  o.schedule = sbp::parse_lr_schedule("cosine,warmup=1");
  o.total_steps = kSteps;
  o.clip_grad_norm = 0.5;
  return o;
}

std::unique_ptr<sbp::Model> case_model(const Case& k) {
  auto model = std::make_unique<sbp::Model>(sbp::preset_config(k.preset), at::kDouble, 21);
  if (!k.lora.empty()) model->add_lora(sbp::parse_lora_spec(k.lora), 22);
  return model;
}

std::vector<Batch> case_batches(const Case& k) {
  auto model = case_model(k);
  auto objective = sbp::make_objective(k.objective);
  std::vector<Batch> out;
  for (int s = 0; s < kSteps; ++s)
    out.push_back(sbp::test::objective_batch(*model, *objective, {kRows, kSeq, 0.4, 0.2, 300 + std::uint64_t(s), k.group}));
  return out;
}

using MethodFactory = std::function<std::unique_ptr<sbp::BackpropMethod>()>;
using ParallelFactory = std::function<std::unique_ptr<sbp::DataParallel>(sbp::Communicator&)>;

MethodFactory method(const std::string& spec) {
  return [spec] { return sbp::make_method(spec); };
}

ParallelFactory ddp(int zero_stage = 0) {
  return [zero_stage](sbp::Communicator& c) { return std::make_unique<sbp::DataParallel>(c, zero_stage); };
}

// One process over the global batch.
Result train_single(const Case& k, const std::vector<Batch>& batches) {
  auto model = case_model(k);
  auto bp = sbp::make_method("standard");
  auto objective = sbp::make_objective(k.objective);
  sbp::Trainer trainer(*model, *bp, *objective, options());
  Result r;
  for (const auto& b : batches) r.losses.push_back(trainer.step(b).loss);
  for (const auto& p : model->trainable()) r.params.push_back({p.name, p.tensor.detach().clone()});
  return r;
}

// `world` ranks as threads; rank 0's result. Correct data parallelism leaves every rank with the same parameters,
// bitwise (checked unless `faulty`: a broken reduction may leave the ranks apart). With sp > 1, groups of sp
// consecutive ranks split each sequence (the data-parallel rank is rank / sp: a group's ranks hold the same rows).
Result train_parallel(const Case& k, const std::vector<Batch>& batches, int world, const MethodFactory& make_method,
                      const ParallelFactory& make_parallel = ddp(), bool faulty = false, int sp = 1) {
  static std::mt19937_64 rng(std::random_device{}());
  const auto dir = std::filesystem::temp_directory_path() / ("streambp-test-ranks-" + std::to_string(rng()));
  std::filesystem::create_directories(dir);
  std::vector<Result> results(world);
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank)
    threads.emplace_back([&, rank] {
      try {
        auto comm = sbp::make_gloo_communicator({.rank = rank, .world_size = world, .file_store = (dir / "store").string(),
                                                 .timeout = std::chrono::seconds(60)});
        auto parallel = make_parallel(*comm);
        const int dp = world / sp, dp_rank = rank / sp;
        std::unique_ptr<sbp::Communicator> sequence;
        if (sp > 1) {
          std::vector<int> members;
          for (int i = 0; i < sp; ++i) members.push_back(dp_rank * sp + i);
          sequence = comm->subgroup("sp" + std::to_string(dp_rank), members);
        }
        auto model = case_model(k);
        auto bp = make_method();
        auto objective = sbp::make_objective(k.objective);
        auto o = options();
        o.sequence_group = sequence.get();
        sbp::Trainer trainer(*model, *bp, *objective, o, parallel.get());
        auto& r = results[rank];
        for (const auto& b : batches) {
          comm->reset_stats();
          if (sequence) sequence->reset_stats();
          r.losses.push_back(trainer.step(objective->split(b, dp, "global batch").at(std::size_t(dp_rank))).loss);
        }
        if (sequence) r.sequence = sequence->stats();
        r.all_reduce = comm->stats().at("all_reduce");
        if (comm->stats().count("all_gather")) r.all_gather = comm->stats().at("all_gather");
        for (const auto& p : model->trainable()) r.resident += p.tensor.numel();
        const sbp::DataParallel::WholeModel whole(*parallel, model->trainable());  // ZeRO-3: gathered
        for (const auto& p : model->trainable()) r.params.push_back({p.name, p.tensor.detach().clone()});
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  std::filesystem::remove_all(dir);
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
  for (int rank = 1; rank < world && !faulty; ++rank)
    for (std::size_t i = 0; i < results[0].params.size(); ++i) {
      INFO("rank " << rank << " " << results[0].params[i].name);
      REQUIRE(at::equal(results[0].params[i].tensor, results[rank].params[i].tensor));
    }
  return results[0];
}

double difference(const Result& ref, const Result& other) {
  return sbp::test::trajectory_difference(ref.losses, ref.params, other.losses, other.params);
}

// The intra-op threads of the process for the test's duration: one per rank-thread.
struct OneThreadPerRank {
  int before = at::get_num_threads();
  OneThreadPerRank() { at::set_num_threads(1); }
  ~OneThreadPerRank() { at::set_num_threads(before); }
};

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {"sft", ""},
      {"sft", "rank=4,alpha=8"},
      {"grpo:beta=0.04,loss_type=grpo", "", 4},
      {"grpo:loss_type=dapo,importance=sequence", "rank=4,alpha=8", 4},
      {"dpo:beta=0.1,label_smoothing=0.1", ""},
      {"dpo:beta=0.1", "rank=4,alpha=8"},
  };
  return all;
}

// The public code's bug: every rank normalises by its own target count (then the SUM over ranks is wrong whenever
// the counts differ; an AVG would be wrong too).
class PerRankNormalisation : public sbp::DataParallel {
 public:
  using DataParallel::DataParallel;
  sbp::StepTotals global_totals(const sbp::StepTotals& local) override { return local; }
};

// The public code's other bug: the final norm and an untied lm_head are never averaged across ranks.
class HeadLeftUnreduced : public sbp::DataParallel {
 public:
  using DataParallel::DataParallel;
  void reduce(const sbp::GradientGroup& group, sbp::OffloadTier* tier) override {
    if (group.name != "head") DataParallel::reduce(group, tier);
  }
};

// A layer reduced before its last chunk's contributions: the chunk loop's sums so far are committed and the layer's
// event fired before the K/V path (step 3) adds W_k's and W_v's (then the real event reduces once more).
class EarlyReducedStreamBP : public sbp::StreamBP {
 public:
  using StreamBP::StreamBP;

 protected:
  void kv_path_backward(const sbp::Model& model, int layer, const at::Tensor& h_in, const at::Tensor& dK,
                        const at::Tensor& dV, at::Tensor& g, sbp::ChunkGradients& weights,
                        sbp::PhaseClock& clock) const override {
    weights.commit();
    layer_ready(model, layer);
    StreamBP::kv_path_backward(model, layer, h_in, dK, dV, g, weights, clock);
  }
};

const std::string kStreamBP = "streambp:layer_chunk=5,head_chunk=7";

}  // namespace

TEST_CASE("data-parallel training with every method of the catalogue over 1-4 ranks, ZeRO 0-3, ends where one "
          "process of standard BP over the global batch ends (fp64, 5 AdamW steps, SFT/GRPO/DPO, full and LoRA)",
          "[distributed][exactness]") {
  const OneThreadPerRank threads;
  // Every method but the reference on 1 rank, on 2 ranks at ZeRO 0 and 3 and on 4 at ZeRO 3; the other settings (2
  // ranks at ZeRO 1 and 2, 4 at ZeRO 0, 3 ranks (24 rows: 8 each) at every stage) one method each, the method turning
  // with the case, so that over the six cases every method meets every setting (twice with three methods). It keeps
  // the test near a minute on 2 cores.
  std::vector<std::string> specs;
  for (const auto& spec : sbp::typical_method_specs(kSeq))
    if (spec != "standard") specs.push_back(spec);
  struct Run {
    int world, stage;
    std::string spec;
  };
  const std::vector<std::pair<int, int>> every_method{{1, 0}, {2, 0}, {2, 3}, {4, 3}};
  const std::vector<std::pair<int, int>> one_method{{2, 1}, {2, 2}, {4, 0}, {3, 0}, {3, 1}, {3, 2}, {3, 3}};
  double worst = 0;
  std::size_t n_runs = 0;
  for (std::size_t c = 0; c < cases().size(); ++c) {
    const auto& k = cases()[c];
    std::vector<Run> runs;
    for (const auto& spec : specs)
      for (const auto& [world, stage] : every_method) runs.push_back({world, stage, spec});
    for (std::size_t i = 0; i < one_method.size(); ++i)
      runs.push_back({one_method[i].first, one_method[i].second, specs[(i + c) % specs.size()]});
    n_runs += runs.size();
    const auto batches = case_batches(k);
    const auto reference = train_single(k, batches);
    for (const auto& r : runs) {
      const double err = difference(reference, train_parallel(k, batches, r.world, method(r.spec), ddp(r.stage)));
      INFO(k.objective << " lora=" << k.lora << " " << r.spec << " world " << r.world << " ZeRO " << r.stage << ": " << err);
      CHECK(err <= 1e-12);
      worst = std::max(worst, err);
    }
  }
  WARN("largest relative difference of losses and final tensors (" << n_runs << " runs of the catalogue's methods over "
       << cases().size() << " cases, 1-4 ranks and ZeRO 0-3, 5 steps each): " << worst);
}

TEST_CASE("data-parallel negative controls fail the same check: per-rank normalisation, an unreduced head, a layer "
          "reduced before its last chunk (DDP and ZeRO-3)", "[distributed][negative-control]") {
  const OneThreadPerRank threads;
  const Case sft{"sft", ""};
  const auto batches = case_batches(sft);
  const auto reference = train_single(sft, batches);
  for (const int stage : {0, 3}) {
    const auto per_rank = difference(reference, train_parallel(sft, batches, 2, method(kStreamBP), [stage](sbp::Communicator& c) {
      return std::make_unique<PerRankNormalisation>(c, stage);
    }, true));
    const auto head = difference(reference, train_parallel(sft, batches, 2, method(kStreamBP), [stage](sbp::Communicator& c) {
      return std::make_unique<HeadLeftUnreduced>(c, stage);
    }, true));
    const auto early = difference(reference, train_parallel(sft, batches, 2, [] {
      return std::make_unique<EarlyReducedStreamBP>(sbp::StreamBP::Options{5, 7});
    }, ddp(stage), true));
    INFO("ZeRO " << stage << ": per-rank normalisation " << per_rank << ", head unreduced " << head << ", early reduction "
                 << early);
    CHECK(per_rank > 1e-6);
    CHECK(head > 1e-6);
    CHECK(early > 1e-6);
  }
}

TEST_CASE("every method's gradient all-reduce moves standard BP's bytes in as many calls (one per group): StreamBP "
          "reduces a layer once, after its last chunk", "[distributed]") {
  const OneThreadPerRank threads;
  for (const auto& k : {Case{"sft", ""}, Case{"sft", "rank=4,alpha=8"}}) {
    const auto batches = case_batches(k);
    const auto standard = train_parallel(k, batches, 2, method("standard")).all_reduce;
    // Groups: the head (final norm; tiny is tied), 2 layers, the embedding; plus the step totals and the loss.
    CHECK(standard.calls == (k.lora.empty() ? 4 : 2) + 2);
    for (const auto& spec : sbp::typical_method_specs(kSeq)) {
      const auto other = train_parallel(k, batches, 2, method(spec)).all_reduce;
      INFO("lora=" << k.lora << ": standard " << standard.calls << " calls " << standard.bytes << " bytes, " << spec
                   << " " << other.calls << " / " << other.bytes);
      CHECK(other.bytes == standard.bytes);
      CHECK(other.calls == standard.calls);
    }
  }
}

TEST_CASE("ZeRO-3: every method gathers each layer once for its forward and once for its backward (StreamBP: for its "
          "whole chunk loop), as standard BP does (all-gather calls and bytes per step equal)", "[distributed]") {
  const OneThreadPerRank threads;
  for (const auto& k : {Case{"sft", ""}, Case{"sft", "rank=4,alpha=8"}}) {
    const auto batches = case_batches(k);
    const auto standard = train_parallel(k, batches, 2, method("standard"), ddp(3)).all_gather;
    // tiny: 2 layers x (forward + backward) + the embedding and head once; LoRA trains no embedding or head.
    CHECK(standard.calls == (k.lora.empty() ? 5 : 4));
    for (const auto& spec : sbp::typical_method_specs(kSeq)) {
      const auto other = train_parallel(k, batches, 2, method(spec), ddp(3)).all_gather;
      INFO("lora=" << k.lora << ": standard " << standard.calls << " calls " << standard.bytes << " bytes, " << spec
                   << " " << other.calls << " / " << other.bytes);
      CHECK(other.bytes == standard.bytes);
      CHECK(other.calls == standard.calls);
    }
    CHECK(train_parallel(k, batches, 2, method(kStreamBP), ddp(3)).resident == 0);  // freed between uses
    CHECK(train_parallel(k, batches, 2, method(kStreamBP), ddp(2)).resident > 0);
  }
}

TEST_CASE("sequence-parallel training (each sequence split over N ranks, StreamBP or checkpointing inside each) ends "
          "where one process of standard BP over the whole sequences ends: fp64, 5 AdamW steps, N = 2, 3, 4 and "
          "DP x SP = 2 x 2 with ZeRO-3, SFT/GRPO/DPO, full and LoRA, GQA and MHA, T not divisible, padded rows, "
          "masked prompts",
          "[distributed][sequence-parallel][exactness]") {
  const OneThreadPerRank threads;
  struct Run {
    int world, sp, stage;
  };
  // T = 21: not divisible by 2 or 4; tiny's 2 KV heads are fewer than 3 and 4 ranks. Every case on every layout, the
  // method inside alternating (each collective is a few hundred bytes here, so the runs are latency-bound: the whole
  // grid of both methods took minutes under ctest -j2); DP x SP with ZeRO-3 sees both methods over the cases.
  const std::vector<Run> runs = {{2, 2, 0}, {3, 3, 0}, {4, 4, 1}, {4, 2, 3}};
  // MHA (the KV heads as many as the heads): one more case, GRPO's sequence importance with LoRA (the worst above).
  auto all = cases();
  all.push_back({"grpo:loss_type=dapo,importance=sequence", "rank=4,alpha=8", 4, "tiny-mha"});
  double worst = 0;
  int index = 0;
  for (const auto& k : all) {
    const auto batches = case_batches(k);
    const auto reference = train_single(k, batches);
    for (const auto& r : runs) {
      const auto spec = index++ % 2 == 0 ? kStreamBP : std::string("checkpoint");
      const double err =
          difference(reference, train_parallel(k, batches, r.world, method(spec), ddp(r.stage), false, r.sp));
      INFO(k.preset << " " << k.objective << " lora=" << k.lora << " " << spec << " world " << r.world << " SP "
                    << r.sp << " ZeRO " << r.stage << ": " << err);
      CHECK(err <= 1e-12);
      worst = std::max(worst, err);
    }
    ++index;  // the next case starts with the other method: each layout sees both
  }
  WARN("sequence-parallel training, largest relative difference of losses and final tensors (" << all.size()
       << " cases x " << runs.size() << " layouts x 5 steps, StreamBP and checkpointing alternating): " << worst);
}

TEST_CASE("a sequence-parallel step's collectives on its group are those of the formula: per micro-batch and layer one "
          "K/V exchange's all-gathers per forward pass (standard BP 1, checkpointing and StreamBP 2) and one's "
          "reduce-scatters (a call per piece of the rows' K and V), an "
          "objective's row statistics one all-reduce, the sequence-length check one all-gather",
          "[distributed][sequence-parallel]") {
  const OneThreadPerRank threads;
  const auto config = sbp::test::tiny_config();
  const int layers = int(config.num_hidden_layers);
  for (const auto& k : {Case{"sft", ""}, Case{"dpo:beta=0.1", "rank=4,alpha=8"}}) {
    const auto batches = case_batches(k);
    const bool row_term = k.objective.rfind("dpo", 0) == 0;
    for (const auto& [spec, gathers] : std::vector<std::pair<std::string, int>>{{"standard", 1}, {"checkpoint", 2},
                                                                                 {kStreamBP, 2}})
      for (const auto& [world, sp] : std::vector<std::pair<int, int>>{{2, 2}, {3, 3}, {4, 2}}) {
        const auto rows = kRows / (world / sp);
        const auto expected = sbp::sequence_step_collectives({.seq_len = kSeq, .world = sp, .layers = layers,
                                                              .micro_batches = 1,
                                                              .slices = 2 * rows * config.num_key_value_heads,
                                                              .slice_position_bytes = config.head_dim * 8,  // fp64
                                                              .gathers_per_layer = gathers,
                                                              .statistics_bytes = row_term ? rows * 8 : 0});
        // One step: the counts are per step.
        const auto got = train_parallel(k, {batches.front()}, world, method(spec), ddp(0), false, sp).sequence;
        INFO(k.objective << " " << spec << " world " << world << " SP " << sp);
        CHECK(got.size() == expected.size());
        for (const auto& [kind, stats] : expected) {
          INFO(kind);
          REQUIRE(got.count(kind));
          CHECK(got.at(kind).calls == stats.calls);
          CHECK(got.at(kind).bytes == stats.bytes);
        }
      }
  }
}

TEST_CASE("ranks of a sequence-parallel group handed sequences of different lengths fail naming the sequence length, "
          "instead of waiting in collectives of other shapes", "[distributed][sequence-parallel]") {
  const OneThreadPerRank threads;
  const Case k{"sft", ""};
  const auto batch = case_batches(k).front();
  const sbp::test::TempDir dir("sbp_sp_mismatch_");
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank)
    ranks.emplace_back([&, rank] {
      try {
        auto comm = sbp::make_gloo_communicator({.rank = rank, .world_size = 2, .file_store = (dir.path() / "store").string(),
                                                 .timeout = std::chrono::seconds(60)});
        sbp::DataParallel parallel(*comm);
        auto model = case_model(k);
        auto bp = sbp::make_method(kStreamBP);
        auto objective = sbp::make_objective(k.objective);
        auto o = options();
        o.sequence_group = comm.get();  // 2 ranks, one group: the communicator itself
        sbp::Trainer trainer(*model, *bp, *objective, o, &parallel);
        // Rank 1 holds the batch one position shorter (a rank reading another file).
        auto mine = batch;
        if (rank == 1) {
          for (auto& field : mine.fields) field.second = field.second.narrow(1, 0, kSeq - 1);
          mine.input_ids = mine.input_ids.narrow(1, 0, kSeq - 1);
          mine.attention_mask = mine.attention_mask.narrow(1, 0, kSeq - 1);
        }
        trainer.step(mine, "batch of rank " + std::to_string(rank));
      } catch (const std::invalid_argument& e) {
        errors[rank] = e.what();
      }
    });
  for (auto& t : ranks) t.join();
  for (const auto& e : errors) {
    INFO(e);
    CHECK_THAT(e, Catch::Contains("rank 1 of the sequence-parallel group holds sequences of 20 positions and rank 0 "
                                  "of 21"));
  }
}

TEST_CASE("a ring hop towards a rank that is gone fails as a peer failure naming the hop and the peer, never as an "
          "internal error (issue #48: a rank killed mid-exchange)", "[distributed][sequence-parallel]") {
  const sbp::test::TempDir dir("sbp_ring_dead_");
  std::string error;
  auto join = [&](int rank) {
    return sbp::make_gloo_communicator({.rank = rank, .world_size = 2, .file_store = (dir.path() / "store").string(),
                                        .timeout = std::chrono::seconds(10)});
  };
  std::thread peer([&] {
    auto comm = join(1);
    comm->ring_shift(at::ones({4}));  // one hop together, then this rank's process group closes (a rank killed)
  });
  auto comm = join(0);
  comm->ring_shift(at::ones({4}));
  peer.join();
  // Gloo notices the closed connection on its own thread: by now the next hop's send is refused as it is posted.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  try {
    comm->ring_shift(at::ones({4}));
  } catch (const sbp::PeerFailure& e) {
    error = e.what();
  }
  INFO(error);
  CHECK_THAT(error, Catch::Matches("rank 0: ring_shift \\((send to|recv from) rank 1\\) failed \\(a peer died or "
                                   "stalled\\?\\): .*"));
}
