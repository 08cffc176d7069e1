// The SFT objective's in-place chunk gradient (what StreamBP's head uses) is the gradient autograd computes from
// its chunk_loss, and the chunk terms of any partition of [0, T) add up to the full loss.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include "core/batch.h"
#include "core/sft.h"
#include "test_support.h"

using namespace sbp;
using sbp::test::tiny_config;

namespace {

// Logits and batch of a small SFT problem with padding and prompt masking, fp64.
struct Problem {
  Batch batch;
  at::Tensor logits;  // [B, T, V]
};

Problem make_problem() {
  const auto config = tiny_config();
  Problem p;
  p.batch = random_sft_batch(config, {3, 23, 0.3, 0.25, 11});
  p.logits = at::randn({3, 23, config.vocab_size}, at::TensorOptions().dtype(at::kDouble)) * 3.0;
  return p;
}

}  // namespace

TEST_CASE("the in-place SFT chunk gradient equals autograd's gradient of the chunk loss", "[objective]") {
  const auto p = make_problem();
  SftObjective sft;
  sft.prepare(p.batch, tiny_config());
  for (const std::int64_t start : {0, 7, 20}) {
    const auto c = std::min<std::int64_t>(9, 23 - start);
    auto fused = p.logits.slice(1, start, start + c).clone();
    auto by_autograd = fused.clone();
    const double fused_loss = sft.chunk_loss_and_grad(fused, start);
    const double autograd_loss = sft.chunk_loss_and_grad_by_autograd(by_autograd, start);  // the generic default
    INFO("chunk [" << start << ", " << start + c << ")");
    CHECK(fused_loss == Approx(autograd_loss).epsilon(1e-14));
    const double scale = by_autograd.abs().max().item<double>();
    CHECK((fused - by_autograd).abs().max().item<double>() <= 1e-14 * scale);
  }
}

TEST_CASE("SFT chunk terms over a partition of the sequence sum to the full loss", "[objective]") {
  const auto p = make_problem();
  SftObjective sft;
  sft.prepare(p.batch, tiny_config());
  const double full = sft.chunk_loss(p.logits, 0).item<double>();
  double streamed = 0;
  for (std::int64_t s = 0; s < 23; s += 5) {
    auto chunk = p.logits.slice(1, s, std::min<std::int64_t>(23, s + 5)).clone();
    streamed += sft.chunk_loss_and_grad(chunk, s);
  }
  CHECK(streamed == Approx(full).epsilon(1e-13));
}
