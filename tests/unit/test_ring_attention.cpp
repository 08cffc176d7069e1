// The ring over key blocks is exact (issue #48, ARCHITECTURE.md §16): N ranks (threads, each its own Gloo group) each
// keep their zig-zag shard's K/V, the blocks travel round the ring and every query merges its attention block by block
// (online softmax); the backward sends each block's dK/dV round with it and home. No rank holds the whole sequence's
// K/V. Against one process over the whole sequence in fp64, to 1e-12; negative controls break the ring in a test
// subclass (a block that skips a hop, dK/dV that never come home, a stale block) and must fail the same gate.
#include <catch2/catch.hpp>

#include <algorithm>
#include <stdexcept>
#include <string>

#include <ATen/ATen.h>

#include "baselines/methods.h"
#include "core/model/lora.h"
#include "core/model/model.h"
#include "core/objectives/sft.h"
#include "core/training/ring_exchange.h"
#include "core/training/sequence_parallel.h"
#include "tests/support/gloo_ranks.h"
#include "tests/support/test_support.h"
#include "verify/grad_compare.h"

namespace {

enum class RingFault {
  none,
  skipped_hop,  // the first hop of every block (and of its sums) goes two ranks on: one block is never seen
  not_home,     // the sums' last hop is not taken: each rank keeps its neighbour's block's dK/dV as its own
  stale_block,  // the first hop's block is not taken in: the rank attends its own block again
};

// The ring with one fault; the hops still run, so that the other ranks' collectives pair up.
class FaultyRing final : public sbp::RingExchange {
 public:
  FaultyRing(sbp::Communicator& comm, std::int64_t T, RingFault fault) : RingExchange(comm, T), fault_(fault) {}

 protected:
  at::Tensor pass_on(const at::Tensor& block, Cargo cargo, int hop) override {
    auto next = RingExchange::pass_on(block, cargo, hop);
    switch (fault_) {
      case RingFault::skipped_hop:
        return cargo != Cargo::home && hop == 0 ? RingExchange::pass_on(next, cargo, hop) : next;
      case RingFault::not_home:
        return cargo == Cargo::home ? block : next;
      case RingFault::stale_block:
        return cargo == Cargo::keys && hop == 0 ? block : next;
      case RingFault::none:
        break;
    }
    return next;
  }

 private:
  RingFault fault_;
};

double normwise_error(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).norm().item<double>() / std::max(b.norm().item<double>(), 1e-300);
}

struct RingShape {
  std::int64_t T, heads, kv_heads;
};

// The worst relative error, over ranks, of the output and q, k, v gradients of the ring's attention (with a graph,
// as standard BP and checkpointing use it) against the whole sequence's causal attention.
double ring_attention_error(int world, const RingShape& shape, RingFault fault = RingFault::none) {
  const std::int64_t B = 2, hd = 8;
  const double scale = 1.0 / std::sqrt(double(hd));
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  at::manual_seed(7);
  const auto q = at::randn({B, shape.heads, shape.T, hd}, opts), k = at::randn({B, shape.kv_heads, shape.T, hd}, opts),
             v = at::randn({B, shape.kv_heads, shape.T, hd}, opts), w = at::randn({B, shape.heads, shape.T, hd}, opts);
  const auto qr = q.clone().requires_grad_(), kr = k.clone().requires_grad_(), vr = v.clone().requires_grad_();
  const auto ref = at::scaled_dot_product_attention(qr, kr, vr, {}, 0.0, true, scale, /*enable_gqa=*/true);
  (ref * w).sum().backward();
  std::vector<double> worst(world, 0.0);
  sbp::test::run_gloo_ranks(world, [&](sbp::Communicator& comm) {
    FaultyRing ring(comm, shape.T, fault);
    const auto index = at::tensor(ring.shard().positions(), at::kLong);
    const auto take = [&](const at::Tensor& t) { return t.index_select(2, index); };
    const auto ql = take(q).requires_grad_(), kl = take(k).requires_grad_(), vl = take(v).requires_grad_();
    const auto o = ring.attend_shard(ql, kl, vl, {scale});
    (o * take(w)).sum().backward();
    worst[comm.rank()] = std::max({normwise_error(o.detach(), take(ref.detach())), normwise_error(ql.grad(), take(qr.grad())),
                                   normwise_error(kl.grad(), take(kr.grad())), normwise_error(vl.grad(), take(vr.grad()))});
  });
  return *std::max_element(worst.begin(), worst.end());
}

struct RingModelCase {
  std::int64_t T, kv_heads;
  std::string method;
  std::string lora = "";  // "": full fine-tuning
  std::string objective = "sft";
};

// The method on `world` ranks over the ring, each on its zig-zag shard of every row (right padding, masked prompts),
// the loss and gradients summed over the group; against one process of standard BP. The largest relative difference.
double ring_step_error(int world, const RingModelCase& c, RingFault fault = RingFault::none) {
  auto config = sbp::test::tiny_config();
  config.num_key_value_heads = c.kv_heads;
  const auto make_model = [&] {
    auto m = std::make_unique<sbp::Model>(config, at::kDouble, 91);
    if (!c.lora.empty()) m->add_lora(sbp::parse_lora_spec(c.lora), 93);
    return m;
  };
  auto reference_model = make_model();
  auto reference_objective = sbp::make_objective(c.objective);
  const auto batch = c.objective == "sft" ? sbp::random_sft_batch(config, {2, c.T, 0.2, 0.25, 92})
                                          : sbp::test::objective_batch(*reference_model, *reference_objective,
                                                                       {2, c.T, 0.2, 0.0, 92});
  const auto reference = sbp::test::run_step(*reference_model, "standard", *reference_objective, batch);
  std::vector<double> errors(world, 0.0);
  sbp::test::run_gloo_ranks(world, [&](sbp::Communicator& comm) {
    auto model = make_model();
    FaultyRing ring(comm, c.T, fault);
    model->set_kv_source(&ring);
    auto objective = sbp::make_objective(c.objective);
    errors[comm.rank()] =
        sbp::test::group_sum_error(comm, sbp::test::run_step(*model, c.method, *objective, batch), reference);
  });
  return *std::max_element(errors.begin(), errors.end());
}

// What the ring's backward holds of each chunk's dO: as it comes (the model dtype), the fp32 copy the ring held before
// (widened up front), or a negative control that changes the held fp32 values below bf16's precision.
enum class HeldGradOutput { as_given, widened, perturbed };

class HeldGradOutputRing final : public sbp::RingExchange {
 public:
  HeldGradOutputRing(sbp::Communicator& comm, std::int64_t T, HeldGradOutput held) : RingExchange(comm, T), held_(held) {}
  at::Tensor held_grad_output(at::Tensor grad_o) const override {
    held_bf16_ = held_bf16_ || grad_o.scalar_type() == at::kBFloat16;
    if (held_ == HeldGradOutput::as_given) return grad_o;
    const auto wide = grad_o.to(at::kFloat);
    return held_ == HeldGradOutput::widened ? wide : wide * (1.0 + 1.0 / 65536.0);
  }
  // Whether a dO came in bf16 (else the comparison would hold trivially).
  bool held_bf16() const { return held_bf16_; }

 private:
  HeldGradOutput held_;
  mutable bool held_bf16_ = false;
};

// Every rank's loss and gradients of one bf16 step of `method` over a ring of `world` ranks (no reduction: each rank's
// own, to be compared bit by bit).
std::vector<sbp::test::StepGradients> bf16_ring_step(int world, const RingModelCase& c, HeldGradOutput held) {
  const auto config = sbp::test::tiny_config();
  const auto batch = sbp::random_sft_batch(config, {2, c.T, 0.2, 0.25, 92});
  std::vector<sbp::test::StepGradients> out(world);
  sbp::test::run_gloo_ranks(world, [&](sbp::Communicator& comm) {
    sbp::Model model(config, at::kBFloat16, 91);
    if (!c.lora.empty()) model.add_lora(sbp::parse_lora_spec(c.lora), 93);
    HeldGradOutputRing ring(comm, c.T, held);
    model.set_kv_source(&ring);
    out[comm.rank()] = sbp::test::run_step(model, c.method, batch);
    if (!ring.held_bf16()) throw std::runtime_error("rank " + std::to_string(comm.rank()) + ": no dO in bf16");
  });
  return out;
}

// The first tensor (by name) whose bits differ between a and b, or "" when none does.
std::string first_bitwise_difference(const std::vector<sbp::test::StepGradients>& a,
                                     const std::vector<sbp::test::StepGradients>& b) {
  for (std::size_t r = 0; r < a.size(); ++r) {
    if (a[r].loss != b[r].loss) return "rank " + std::to_string(r) + " loss";
    REQUIRE(a[r].gradients.size() == b[r].gradients.size());
    for (std::size_t i = 0; i < a[r].gradients.size(); ++i)
      if (!at::equal(a[r].gradients[i].tensor, b[r].gradients[i].tensor))
        return "rank " + std::to_string(r) + " " + a[r].gradients[i].name;
  }
  return "";
}

}  // namespace

// bf16: dO is the gradient of o_proj's bf16 input, so holding it in bf16 and widening each part in key_block_backward
// hands the kernel the values the fp32 copy held before did. The whole step's gradients are the same bits.
TEST_CASE("the ring's backward holding dO in bf16 gives bitwise the gradients of holding its fp32 copy: StreamBP "
          "standard BP and LoRA at N = 2 and 3 and a negative control that moves the held dO below bf16's precision",
          "[sequence-parallel][ring][distributed]") {
  const std::string streambp = "streambp:layer_chunk=3,head_chunk=4";
  for (const int world : {2, 3})
    for (const auto& c : {RingModelCase{37, 2, streambp}, RingModelCase{37, 2, "standard"},
                          RingModelCase{41, 2, streambp, "rank=8"}}) {
      const auto held = bf16_ring_step(world, c, HeldGradOutput::as_given);
      const auto before = bf16_ring_step(world, c, HeldGradOutput::widened);
      const auto control = first_bitwise_difference(bf16_ring_step(world, c, HeldGradOutput::perturbed), before);
      INFO(c.method << " lora '" << c.lora << "' on " << world << " ranks: first difference '"
                    << first_bitwise_difference(held, before) << "', the control's '" << control << "'");
      CHECK(first_bitwise_difference(held, before).empty());
      CHECK_FALSE(control.empty());
    }
}

// K and V blocks go round the ring, merged by log-sum-exp; their gradients travel with them and come home.
TEST_CASE("ring attention equals the whole sequence's causal attention in fp64: N = 2, 3, 4, GQA with fewer KV heads "
          "than ranks and MHA, T not divisible", "[sequence-parallel][ring][distributed]") {
  double worst = 0;
  for (const int world : {2, 3, 4})
    for (const auto& shape : {RingShape{37, 4, 1}, RingShape{48, 4, 2}, RingShape{29, 3, 3}}) {
      const auto e = ring_attention_error(world, shape);
      INFO(world << " ranks, T " << shape.T << ", heads " << shape.heads << "x" << shape.kv_heads << ": " << e);
      CHECK(e <= 1e-12);
      worst = std::max(worst, e);
    }
  WARN("ring attention: largest relative difference " << worst);
}

TEST_CASE("StreamBP over a ring of N ranks equals one process of standard BP in fp64 (gradients summed over the "
          "group): N = 2, 3, 4, T not divisible, GQA with fewer KV heads than ranks, padded rows and masked prompts, "
          "chunks several per block and one per block", "[sequence-parallel][ring][distributed]") {
  double worst = 0;
  for (const int world : {2, 3, 4})
    for (const auto& c : {RingModelCase{37, 1, "streambp:layer_chunk=2,head_chunk=3"},
                          RingModelCase{41, 2, "streambp:layer_chunk=64,head_chunk=64"}}) {
      const auto e = ring_step_error(world, c);
      INFO(c.method << " on " << world << " ranks, T " << c.T << ", KV heads " << c.kv_heads << ": " << e);
      CHECK(e <= 1e-12);
      worst = std::max(worst, e);
    }
  WARN("StreamBP over a ring: largest relative difference " << worst);
}

TEST_CASE("standard BP and checkpointing over a ring, and StreamBP with LoRA, GRPO (token and sequence importance) and "
          "DPO, equal one process of standard BP in fp64", "[sequence-parallel][ring][distributed]") {
  double worst = 0;
  const std::string streambp = "streambp:layer_chunk=3,head_chunk=4";
  for (const auto& c : {RingModelCase{37, 1, "standard"}, RingModelCase{37, 2, "checkpoint"},
                        RingModelCase{48, 2, streambp, "rank=8"}, RingModelCase{41, 2, streambp, "", "grpo"},
                        RingModelCase{41, 1, streambp, "rank=8", "grpo:importance=sequence"},
                        RingModelCase{43, 2, streambp, "", "dpo"}, RingModelCase{43, 2, "checkpoint", "rank=8", "dpo"}}) {
    const auto e = ring_step_error(3, c);
    INFO(c.method << ", " << c.objective << ", T " << c.T << ", KV heads " << c.kv_heads << ", lora '" << c.lora
                  << "': " << e);
    CHECK(e <= 1e-12);
    worst = std::max(worst, e);
  }
  WARN("methods and objectives over a ring: largest relative difference " << worst);
}

TEST_CASE("negative controls: a block that skips a hop, dK/dV not carried home and a stale block fail the ring's gate",
          "[sequence-parallel][ring][distributed][negative-control]") {
  for (const auto fault : {RingFault::skipped_hop, RingFault::not_home, RingFault::stale_block}) {
    const auto attention = ring_attention_error(3, {37, 4, 1}, fault);
    const auto streambp = ring_step_error(3, {37, 1, "streambp:layer_chunk=2,head_chunk=3"}, fault);
    INFO("fault " << int(fault) << ": attention " << attention << ", StreamBP " << streambp);
    CHECK(attention > 1e-3);
    CHECK(streambp > 1e-3);
  }
}

TEST_CASE("the ring's hops are counted, and their calls and bytes are the formula's: per layer N - 1 hops of the "
          "rank's padded K/V block per forward pass, N - 1 more and N of its dK/dV sums in the backward",
          "[sequence-parallel][ring][distributed]") {
  const auto config = sbp::test::tiny_config();
  const std::int64_t T = 37, B = 2;
  const auto batch = sbp::random_sft_batch(config, {B, T, 0.2, 0.25, 92});
  for (const auto& [method, forward_passes] : std::vector<std::pair<std::string, int>>{
           {"standard", 1}, {"checkpoint", 2}, {"streambp:layer_chunk=4,head_chunk=5", 2}})
    for (const int world : {2, 3}) {
      const std::string spec = method;  // a lambda may not capture a structured binding (clang, C++20)
      std::vector<sbp::CollectiveStats> hops(world);
      sbp::test::run_gloo_ranks(world, [&](sbp::Communicator& comm) {
        sbp::Model model(config, at::kDouble, 91);
        sbp::RingExchange ring(comm, T);
        model.set_kv_source(&ring);
        sbp::SftObjective objective;
        sbp::test::run_step(model, spec, objective, batch);
        hops[comm.rank()] = comm.stats().at("ring_shift");
      });
      const auto expected = sbp::sequence_step_collectives(
          {.seq_len = T, .world = world, .layers = int(config.num_hidden_layers), .micro_batches = 1,
           .slices = 2 * B * config.num_key_value_heads, .slice_position_bytes = config.head_dim * 8,  // fp64
           .gathers_per_layer = forward_passes, .scheme = sbp::SequenceScheme::ring});
      // Analytic: layers x hops per layer, e.g. StreamBP at N = 3: 2 x (3 x 2 + 3) = 18.
      CHECK(expected.at("ring_shift").calls ==
            config.num_hidden_layers * ((forward_passes + 1) * (world - 1) + world));
      for (int r = 0; r < world; ++r) {
        INFO(spec << " on " << world << " ranks, rank " << r << ": " << hops[r].calls << " hops, " << hops[r].bytes
                  << " bytes");
        CHECK(hops[r].calls == expected.at("ring_shift").calls);
        CHECK(hops[r].bytes == expected.at("ring_shift").bytes);
      }
    }
}
