// Packed rows are exact in every method (ARCHITECTURE.md §3 "Packed rows", §8): a packed batch gives, in fp64 and on every
// tensor, the gradients of the same sequences given as right-padded rows with the same normaliser (the first oracle;
// HF's own packed path is the second, tests/oracle/hf_packed_parity.py). Each known way of packing wrongly makes that
// gate fail, and StreamBP's chunk attention never reads a key no query of its chunk can see.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "baselines/methods.h"
#include "core/model/chunk_attention.h"
#include "core/model/model.h"
#include "core/model/packed_attention.h"
#include "core/model/packed_rows.h"
#include "core/objectives/packed_batch.h"
#include "core/objectives/sft.h"
#include "tests/support/faulty_packing.h"
#include "tests/support/test_support.h"
#include "verify/grad_compare.h"

using sbp::Batch;
using sbp::ModelConfig;
using sbp::PackedRows;
using sbp::test::run_step;

namespace {

constexpr double kFp64Rtol = 1e-10;  // the exactness gate of test_exactness.cpp
constexpr double kLossRtol = 1e-12;
constexpr std::int64_t kT = 48;

// Two rows of 48 covering what a chunk loop can get wrong at a boundary: a sequence of one token, sequences that
// straddle chunks of 4, 6, 12 and 16, boundaries on a chunk's first position (12, 24, 36 in row 0), a long sequence
// beside short ones, and the rows packed differently (so a chunk's earliest sequence starts elsewhere in each row).
const std::vector<std::vector<std::int64_t>> kLengths = {{5, 1, 6, 12, 9, 3, 12}, {30, 2, 16}};

// The tiny preset (GQA, qk_norm, tied) and its untied, biased MHA corner.
std::vector<ModelConfig> configs() { return {sbp::test::tiny_config(), sbp::test::untied_mha_with_biases()}; }

// The tiny preset in fp64 on kLengths' rows: a model and a packed SFT batch of two seeds.
struct TinyPacked {
  explicit TinyPacked(std::uint64_t seed, double prompt_fraction = 0.0)
      : model(config, at::kDouble, seed), batch(sbp::packed_sft_batch(config, kLengths, prompt_fraction, seed + 1)) {}
  ModelConfig config = sbp::test::tiny_config();
  sbp::Model model;
  Batch batch;
};

// What a packed step gives against the padded oracle: its loss's relative error and its worst tensor's.
struct Gate {
  double loss_error = 0;
  sbp::GradComparison gradients;
};
// `step` run by the method against the sequences of `packed` given as right-padded rows (`step` is `packed` itself
// but for a negative control's changes).
Gate against_padded(sbp::Model& model, const std::string& spec, sbp::Objective& objective, const Batch& packed,
                    const Batch& step_batch) {
  const auto oracle = run_step(model, "standard", sbp::padded_sequences(packed));
  const auto step = run_step(model, spec, objective, step_batch);
  return {std::abs(step.loss - oracle.loss) / std::abs(oracle.loss),
          sbp::compare_gradients(oracle.gradients, step.gradients)};
}
Gate against_padded(sbp::Model& model, const std::string& spec, sbp::Objective& objective, const Batch& packed) {
  return against_padded(model, spec, objective, packed, packed);
}

}  // namespace

TEST_CASE("every method on packed rows equals the same sequences as padded rows in fp64", "[packed][exactness]") {
  std::vector<std::string> specs = {"standard"};
  for (const auto& s : sbp::edge_method_specs(kT)) specs.push_back(s);
  double largest = 0;
  std::string largest_case;
  for (const auto& config : configs()) {
    sbp::Model model(config, at::kDouble, 41);
    const auto batch = sbp::packed_sft_batch(config, kLengths, 0.25, 42);
    sbp::validate_tokens(batch, config, "packed");
    sbp::SftObjective sft;
    for (const auto& spec : specs) {
      INFO(spec << " on " << sbp::test::describe(config));
      const auto gate = against_padded(model, spec, sft, batch);
      INFO("loss error " << gate.loss_error << ", worst tensor " << (gate.gradients.worst() ? gate.gradients.worst()->name : "-")
                         << " at " << gate.gradients.max_normwise_rel());
      CHECK(gate.gradients.problems.empty());
      CHECK(gate.loss_error <= kLossRtol);
      CHECK(gate.gradients.passed(kFp64Rtol));
      if (gate.gradients.max_normwise_rel() >= largest)
        largest = gate.gradients.max_normwise_rel(), largest_case = spec + " on " + sbp::test::describe(config);
    }
  }
  WARN("largest fp64 normwise relative error of a packed step against its padded sequences: " << largest << " ("
                                                                                               << largest_case << ")");
}

TEST_CASE("packed micro-batches normalised by the step's target count equal the whole packed batch",
          "[packed][exactness]") {
  // HF/TRL's num_items_in_batch: each pack's loss is divided by the step's scored tokens, never by its own.
  TinyPacked tiny(47, 0.25);
  auto& [config, model, batch] = tiny;
  sbp::SftObjective sft;
  const std::string spec = "streambp:layer_chunk=7,head_chunk=5";
  const auto whole = run_step(model, spec, sft, batch);
  const auto totals = sft.prepare(batch, config).batch_totals();
  const auto method = sbp::make_method(spec);
  model.zero_grad();
  const auto parts = sft.split(batch, 2, "packed");
  for (std::size_t k = 0; k < parts.size(); ++k)
    method->step(model, sft, parts[k], {.accumulate = k > 0, .step_totals = totals});
  const auto cmp = sbp::compare_gradients(whole.gradients, model.gradients());
  INFO("worst " << cmp.max_normwise_rel());
  CHECK(cmp.problems.empty());
  CHECK(cmp.passed(kFp64Rtol));
}

TEST_CASE("the packed gate fails on attention across a boundary, unrestarted positions and a kept separator",
          "[packed][exactness][negative-control]") {
  TinyPacked tiny(43);
  auto& [config, model, batch] = tiny;
  sbp::SftObjective sft;
  sbp::test::SeparatorKeepingSft keeps_separator;
  for (const std::string spec : {"standard", "checkpoint", "mst:mini_seq=5", "streambp:layer_chunk=7,head_chunk=5"}) {
    INFO(spec);
    CHECK(against_padded(model, spec, sft, batch).gradients.passed(kFp64Rtol));  // the control
    // Row 1's boundary at 30 sits inside streambp's chunk [28, 35): the leak crosses a chunk's runs.
    auto leaky = batch;
    leaky.packed = std::make_shared<sbp::test::LeakyBoundaryRows>(*batch.packed, 1, 30);
    auto unrestarted = batch;
    unrestarted.packed = std::make_shared<sbp::test::UnrestartedPositionRows>(*batch.packed);
    auto unpacked = batch;  // position_ids dropped, as a collator that forgets them: one sequence per row
    unpacked.packed = nullptr;
    // The smallest error each fault makes. RoPE is relative: rotating a whole sequence by a constant offset leaves its
    // scores unchanged in exact arithmetic, so positions not restarted (attention still within each sequence) show
    // only through the fp32 rounding of the larger angles, as HF computes them (1.6e-7 here at T = 48, growing with
    // the position), still 1000x the gate. The others change the function: O(1e-3..1).
    for (const auto& [what, gate, least] :
         {std::tuple{"attention across one boundary", against_padded(model, spec, sft, batch, leaky), 1e-6},
          {"positions not restarted", against_padded(model, spec, sft, batch, unrestarted), 1e-8},
          {"no boundaries (position_ids dropped)", against_padded(model, spec, sft, batch, unpacked), 1e-6},
          {"one separator label kept", against_padded(model, spec, keeps_separator, batch), 1e-6}}) {
      INFO(what << ": worst " << gate.gradients.max_normwise_rel());
      CHECK(gate.gradients.problems.empty());
      CHECK_FALSE(gate.gradients.passed(kFp64Rtol));
      CHECK(gate.gradients.max_normwise_rel() > least);
    }
  }
}

namespace {

// Attention of queries [q_start, q_start + c) over keys [0, q_start + c) of packed rows, written out: scores, a
// [B, 1, c, e] mask of each query's own sequence up to itself, softmax. Differentiable in q, k and v.
at::Tensor masked_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::int64_t q_start,
                            double scale, const PackedRows& rows) {
  const auto B = q.size(0), c = q.size(2), e = k.size(2), group = q.size(1) / k.size(1);
  auto allowed = at::zeros({B, 1, c, e}, at::kBool);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < c; ++i) {
      const auto p = q_start + i;
      allowed[b][0][i].slice(0, rows.sequence_start(b, p), p + 1).fill_(true);
    }
  const auto scores = at::matmul(q, k.repeat_interleave(group, 1).transpose(-1, -2)) * scale;
  const auto weights = at::softmax(scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity()), -1);
  return at::matmul(weights, v.repeat_interleave(group, 1));
}

}  // namespace

TEST_CASE("packed chunk attention skips the keys before its earliest sequence and masks none it reads",
          "[packed][chunk-attention]") {
  // Row 0: [7 | 5 | 4], row 1: [3 | 13]. Queries [9, 14) start inside row 0's second sequence (at 7) and cross its
  // boundary at 12; in row 1 they lie in the sequence from 3. Keys before 7 (row 0) and 3 (row 1) are NaN: read, even
  // masked, they would poison the output or the sums.
  const auto rows = PackedRows::from_lengths({{7, 5, 4}, {3, 13}}, 16);
  const std::int64_t q_start = 9, c = 5, e = q_start + c;
  const double scale = 0.3;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const auto q = at::randn({2, 4, c, 8}, gen, f64), k = at::randn({2, 2, e, 8}, gen, f64), v = at::randn({2, 2, e, 8}, gen, f64);
  const auto grad_o = at::randn({2, 4, c, 8}, gen, f64);
  const auto poisoned = [&](const at::Tensor& t) {
    auto out = t.clone();
    out[0].slice(1, 0, 7).fill_(std::nan(""));
    out[1].slice(1, 0, 3).fill_(std::nan(""));
    return out;
  };
  const auto kp = poisoned(k), vp = poisoned(v);

  // The reference and its gradients, on the clean keys.
  auto q_ref = q.clone().requires_grad_(true), k_ref = k.clone().requires_grad_(true), v_ref = v.clone().requires_grad_(true);
  const auto o_ref = masked_reference(q_ref, k_ref, v_ref, q_start, scale, *rows);
  o_ref.backward(grad_o);

  // With a graph through q, k and v (standard BP's and checkpointing's whole-sequence call, here at q_start > 0).
  auto q1 = q.clone().requires_grad_(true);
  const auto o1 = sbp::packed_attention(q1, kp, vp, q_start, scale, nullptr, *rows);
  CHECK(at::isfinite(o1).all().item<bool>());
  CHECK(at::allclose(o1, o_ref, 1e-12, 1e-12));

  // StreamBP's: K/V constants, their gradients added into fp64 sums over [0, T).
  sbp::KVGradSums sums{at::zeros({2, 2, 16, 8}, f64), at::zeros({2, 2, 16, 8}, f64)};
  auto q2 = q.clone().requires_grad_(true);
  sbp::packed_attention(q2, kp, vp, q_start, scale, &sums, *rows).backward(grad_o);
  CHECK(at::allclose(q2.grad(), q_ref.grad(), 1e-12, 1e-12));
  for (const auto& [sum, ref] : {std::pair{sums.dK, k_ref.grad()}, {sums.dV, v_ref.grad()}}) {
    CHECK(at::isfinite(sum).all().item<bool>());
    CHECK(sum[0].slice(1, 0, 7).abs().max().item<double>() == 0.0);  // never touched
    CHECK(sum[1].slice(1, 0, 3).abs().max().item<double>() == 0.0);
    CHECK(at::allclose(sum.slice(2, 0, e), ref, 1e-12, 1e-12));  // the reference's are 0 where a key is masked
  }
}

TEST_CASE("StreamBP on packed rows in bf16 stays within the low-precision rule", "[packed][exactness][bf16]") {
  // The rule of ARCHITECTURE.md §8 against the fp64 oracle on the same bf16 weights, both sides packed.
  auto config = sbp::test::tiny_config();
  config.tie_word_embeddings = false;
  sbp::Model model(config, at::kBFloat16, 45);
  sbp::Model oracle_model(config, at::kDouble, model.parameters(), "bf16 weights");
  const auto batch = sbp::packed_sft_batch(config, {{40, 7, 1, 16}}, 0.1, 46);
  const auto oracle = run_step(oracle_model, "standard", batch);
  const auto standard = run_step(model, "standard", batch);
  for (const std::string spec : {"streambp:layer_chunk=8,head_chunk=8", "checkpoint", "mst:mini_seq=4"}) {
    const auto method = run_step(model, spec, batch);
    const auto verdict = sbp::low_precision_rule(sbp::compare_gradients(oracle.gradients, standard.gradients),
                                                 sbp::compare_gradients(oracle.gradients, method.gradients), at::kBFloat16);
    INFO(spec << ": " << verdict.worst_tensor << " at " << verdict.worst_ratio << " of its allowance");
    CHECK(verdict.passed());
  }
}
