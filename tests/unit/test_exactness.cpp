// (Over 500 lines: the SFT exactness cases share one set of helpers, the fp64 comparisons and the bf16 rule's
// error runs; the objectives' and LoRA's cases live in test_objective_exactness.cpp.)
// The paper's central claim, checked on every parameter tensor: StreamBP computes the exact gradient of standard
// backpropagation (ARCHITECTURE.md §4 "Exactness", §8). In fp64 every method must agree to 1e-10 normwise relative error
// per tensor (max|a-b| / max|a|); the only difference allowed is floating-point summation order.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include "core/objectives/batch.h"
#include "core/model/chunk_attention_kernels.h"
#include "core/model/model.h"
#include "core/objectives/sft.h"
#include "baselines/methods.h"
#include "core/methods/streambp.h"
#include "tests/support/faulty_methods.h"
#include "tests/support/test_support.h"
#include "verify/grad_compare.h"

using sbp::Batch;
using sbp::ModelConfig;
using sbp::RandomBatchOptions;
using sbp::test::describe;
using sbp::test::run_step;

namespace {

using sbp::test::kFp64Rtol;  // the fp64 gate (tests/support/test_support.h)
using sbp::test::kLossRtol;

double relative_difference(double reference, double other) {
  return std::abs(reference - other) / std::abs(reference);
}

// Every gradient of `other` matches `ref` within rtol, with no tensor missing on either side. Returns the largest
// normwise relative error.
double check_gradients_match(const sbp::TensorList& ref, const sbp::TensorList& other, double rtol) {
  const auto cmp = sbp::compare_gradients(ref, other);
  std::string problems;
  for (const auto& problem : cmp.problems) problems += problem + "; ";
  INFO("problems: " << problems);
  CHECK(cmp.problems.empty());
  CHECK(cmp.tensors.size() == ref.size());
  const auto* worst = cmp.worst();
  INFO("largest normwise relative error " << cmp.max_normwise_rel() << " in " << (worst ? worst->name : "-"));
  CHECK(cmp.passed(rtol));
  return cmp.max_normwise_rel();
}

struct ExactShape {
  std::string what;
  ModelConfig config;
  RandomBatchOptions batch;
};

std::vector<ExactShape> standard_vs_checkpoint_shapes() {
  std::vector<ExactShape> shapes;
  ModelConfig qwen3 = sbp::test::tiny_config();  // GQA 4/2, qk_norm, tied
  shapes.push_back({"qwen3 tiny, ragged B=2", qwen3, {2, 24, 0.3, 0.0, 11}});

  ModelConfig untied_mha = sbp::test::untied_mha_with_biases();
  shapes.push_back({"untied MHA with q/k/v/o bias, prompt-masked B=3", untied_mha, {3, 17, 0.4, 0.25, 12}});

  ModelConfig qwen2 = qwen3;
  qwen2.qk_norm = false;
  qwen2.attention_bias = true;
  shapes.push_back({"qwen2-style q/k/v bias, B=1", qwen2, {1, 31, 0.2, 0.0, 13}});

  ModelConfig llama_mqa = qwen3;
  llama_mqa.qk_norm = false;
  llama_mqa.tie_word_embeddings = false;
  llama_mqa.num_key_value_heads = 1;
  shapes.push_back({"llama-style untied MQA, B=2", llama_mqa, {2, 20, 0.25, 0.3, 14}});

  ModelConfig qk_norm_bias = untied_mha;
  qk_norm_bias.qk_norm = true;
  qk_norm_bias.num_key_value_heads = 2;
  shapes.push_back({"qk_norm with every bias, GQA, B=3", qk_norm_bias, {3, 19, 0.35, 0.2, 15}});
  return shapes;
}

}  // namespace

TEST_CASE("standard and checkpoint gradients are equal in fp64", "[exactness]") {
  for (const auto& shape : standard_vs_checkpoint_shapes()) {
    INFO(shape.what << ": " << describe(shape.config) << ",B=" << shape.batch.batch_size << ",T="
                    << shape.batch.seq_len << ",pad=" << shape.batch.pad_fraction);
    sbp::Model model(shape.config, at::kDouble, 100 + shape.batch.seed);
    const Batch batch = sbp::random_sft_batch(shape.config, shape.batch);
    sbp::validate_tokens(batch, shape.config, "random batch");
    const auto standard = run_step(model, "standard", batch);
    const auto checkpoint = run_step(model, "checkpoint", batch);
    CHECK(relative_difference(standard.loss, checkpoint.loss) <= kLossRtol);
    check_gradients_match(standard.gradients, checkpoint.gradients, kFp64Rtol);
  }
}

namespace {

// One case of the StreamBP sweep. Its id encodes every parameter (like ggml's test-backend-ops), so a failure
// names everything needed to rebuild the case.
struct SweepCase {
  ModelConfig config;
  RandomBatchOptions batch;
  std::int64_t layer_chunk = 1, head_chunk = 1;
  std::uint64_t model_seed = 0;

  std::string spec() const {
    return "streambp:layer_chunk=" + std::to_string(layer_chunk) + ",head_chunk=" + std::to_string(head_chunk);
  }
  std::string id() const {
    std::ostringstream s;
    s << "STREAMBP(T=" << batch.seq_len << ",c=" << layer_chunk << ",c_h=" << head_chunk << ",B=" << batch.batch_size
      << ",pad=" << batch.pad_fraction << ",prompt=" << batch.prompt_fraction << "," << describe(config)
      << ",model_seed=" << model_seed << ",batch_seed=" << batch.seed << ")";
    return s.str();
  }
};

// True when some position t >= 1 carries loss (a valid label at t + 1 >= 2), i.e. a query that attends to at least
// two keys. Otherwise every softmax that carries loss has a single key and is constantly 1, so the gradients of the
// q/k path (q/k projections and biases, q/k norms) are exactly zero in exact arithmetic: both methods return rounding
// noise (~1e-18) there, and the relative error of noise against noise is O(1) and means nothing. T = 2, or T = 3
// with one pad, are such batches.
bool attention_gets_gradient(const Batch& batch) {
  return (batch.field("labels").slice(1, 2) != -100).any().item<bool>();
}

// The sweep draws from a fixed seed, so it is the same list on every run. The layer chunk's relation to T cycles
// through the four situations a chunked loop can get wrong; everything else is drawn independently.
std::vector<SweepCase> sweep_cases(int count) {
  std::mt19937_64 rng(20250607);
  auto pick = [&](std::initializer_list<std::int64_t> values) {
    return *(values.begin() + std::uniform_int_distribution<std::size_t>(0, values.size() - 1)(rng));
  };
  auto between = [&](std::int64_t lo, std::int64_t hi) { return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng); };
  auto coin = [&] { return std::bernoulli_distribution(0.5)(rng); };

  std::vector<SweepCase> cases;
  for (int i = 0; i < count; ++i) {
    SweepCase k;
    ModelConfig& c = k.config;
    c.name = "sweep";
    c.head_dim = pick({8, 16});
    c.num_attention_heads = pick({2, 4});
    c.num_key_value_heads = coin() ? c.num_attention_heads : pick({1, 2});  // MHA, or GQA/MQA
    c.hidden_size = pick({32, 48, 64});
    c.intermediate_size = pick({32, 64, 96});
    c.num_hidden_layers = pick({1, 2});
    c.vocab_size = pick({64, 128, 512});
    c.tie_word_embeddings = coin();
    c.qk_norm = coin();
    c.attention_bias = coin();
    c.o_proj_bias = coin();

    std::int64_t T = 0;
    switch (i % 4) {
      case 0:  // several chunks and a remainder: T is not a multiple of c
        T = between(5, 48);
        do k.layer_chunk = between(2, T - 1);
        while (T % k.layer_chunk == 0);
        break;
      case 1:  // one token per chunk: every chunk but the first has s > 0, the mask is one row
        T = between(3, 12);
        k.layer_chunk = 1;
        break;
      case 2:  // one chunk covering the sequence, exactly or with room to spare
        T = between(3, 48);
        k.layer_chunk = T + pick({0, 1, 7});
        break;
      default:  // several equal chunks
        k.layer_chunk = between(2, 8);
        T = k.layer_chunk * between(2, 6);
        break;
    }
    switch (between(0, 2)) {  // independent of the layer chunk
      case 0: k.head_chunk = 1; break;
      case 1: k.head_chunk = between(1, T); break;
      default: k.head_chunk = T + pick({0, 3}); break;
    }
    do {
      k.batch = {between(1, 3), T, double(pick({0, 20, 40})) / 100.0, double(pick({0, 30})) / 100.0,
                 std::uint64_t(between(0, 1 << 20))};
    } while (!attention_gets_gradient(sbp::random_sft_batch(c, k.batch)));  // terminates: T >= 3 without pads qualifies
    k.model_seed = std::uint64_t(between(0, 1 << 20));
    cases.push_back(k);
  }
  return cases;
}

}  // namespace

TEST_CASE("StreamBP gradients equal standard BP in fp64 for every parameter", "[exactness][streambp]") {
  const auto cases = sweep_cases(128);
  double largest_error = 0;
  std::string largest_case;
  std::set<std::string> covered;  // which corners of the parameter space the sweep reached
  for (const auto& k : cases) {
    INFO(k.id());
    sbp::Model model(k.config, at::kDouble, k.model_seed);
    const Batch batch = sbp::random_sft_batch(k.config, k.batch);
    sbp::validate_tokens(batch, k.config, k.id());
    const auto standard = run_step(model, "standard", batch);
    const auto stream = run_step(model, k.spec(), batch);
    CHECK(relative_difference(standard.loss, stream.loss) <= kLossRtol);
    const double error = check_gradients_match(standard.gradients, stream.gradients, kFp64Rtol);
    if (error >= largest_error) largest_error = error, largest_case = k.id();

    const auto T = k.batch.seq_len, c = k.layer_chunk, ch = k.head_chunk;
    if (c < T && T % c != 0) covered.insert("T not a multiple of layer_chunk");
    if (c == 1 && T > 1) covered.insert("layer_chunk 1");
    if (c >= T) covered.insert("layer_chunk >= T");
    if (ch < T && ch != c) covered.insert("head_chunk < T, != layer_chunk");
    if (ch >= T) covered.insert("head_chunk >= T");
    if (ch == 1) covered.insert("head_chunk 1");
    covered.insert("B=" + std::to_string(k.batch.batch_size));
    if (k.batch.pad_fraction > 0 && k.batch.batch_size > 1) covered.insert("ragged right padding");
    if (k.batch.prompt_fraction > 0) covered.insert("prompt-masked labels");
    covered.insert(k.config.num_key_value_heads < k.config.num_attention_heads ? "GQA" : "MHA");
    covered.insert(k.config.tie_word_embeddings ? "tied" : "untied");
    covered.insert(std::string("qk_norm ") + (k.config.qk_norm ? "on" : "off"));
    covered.insert(std::string("attention_bias ") + (k.config.attention_bias ? "on" : "off"));
    covered.insert(std::string("o_proj_bias ") + (k.config.o_proj_bias ? "on" : "off"));
    covered.insert("L=" + std::to_string(k.config.num_hidden_layers));
  }
  WARN("largest fp64 normwise relative error over " << cases.size() << " StreamBP cases: " << largest_error << " in "
                                                    << largest_case);
  for (const char* corner :
       {"T not a multiple of layer_chunk", "layer_chunk 1", "layer_chunk >= T", "head_chunk < T, != layer_chunk",
        "head_chunk >= T", "head_chunk 1", "B=1", "B=2", "B=3", "ragged right padding", "prompt-masked labels", "GQA",
        "MHA", "tied", "untied", "qk_norm on", "qk_norm off", "attention_bias on", "attention_bias off",
        "o_proj_bias on", "o_proj_bias off", "L=1", "L=2"}) {
    INFO("the sweep must reach: " << corner);
    CHECK(covered.count(corner) == 1);
  }
}

TEST_CASE("MsT gradients equal standard BP in fp64 for every parameter", "[exactness][mst]") {
  // The StreamBP sweep's cases, with M = the case's layer chunk as the number of mini-sequences: one token each,
  // one mini-sequence, M > T, and remainders all occur.
  std::set<std::string> covered;
  for (const auto& k : sweep_cases(40)) {
    const std::string spec = "mst:mini_seq=" + std::to_string(k.layer_chunk);
    INFO(spec << " " << k.id());
    sbp::Model model(k.config, at::kDouble, k.model_seed);
    const Batch batch = sbp::random_sft_batch(k.config, k.batch);
    const auto standard = run_step(model, "standard", batch);
    const auto mst = run_step(model, spec, batch);
    CHECK(relative_difference(standard.loss, mst.loss) <= kLossRtol);
    check_gradients_match(standard.gradients, mst.gradients, kFp64Rtol);
    const auto T = k.batch.seq_len, len = (T + k.layer_chunk - 1) / k.layer_chunk;
    if (T % len != 0) covered.insert("remainder mini-sequence");
    if (len == 1) covered.insert("one token per mini-sequence");
    if (len == T) covered.insert("one mini-sequence");
  }
  for (const char* corner : {"remainder mini-sequence", "one token per mini-sequence", "one mini-sequence"}) {
    INFO("the sweep must reach: " << corner);
    CHECK(covered.count(corner) == 1);
  }
}

TEST_CASE("StreamBP in fp32 and bf16 is as close to the fp64 oracle as standard BP in the same dtype",
          "[exactness][streambp][low-precision]") {
  // The low-precision rule (verify/grad_compare.h): a method's (l2) error may be at most allowance(n) x the standard
  // method's error in the same dtype, plus a floor: the error of storing every entry at the model's rounding floor
  // (low_precision_floor). The oracle is standard BP in fp64 on the very same weights (the low-precision weights
  // widened), so that only the arithmetic of the step is measured, not the rounding of the weights.
  struct LowPrecisionCase {
    c10::ScalarType dtype;
    bool tied, qk_norm, bias;
    std::int64_t kv_heads;
  };
  const std::vector<LowPrecisionCase> cases = {
      {at::kFloat, true, true, false, 2}, {at::kFloat, false, false, true, 4},
      {at::kBFloat16, true, true, false, 2}, {at::kBFloat16, false, false, true, 4}};
  for (const auto& k : cases) {
    ModelConfig config = sbp::test::tiny_config();
    config.tie_word_embeddings = k.tied;
    config.qk_norm = k.qk_norm;
    config.attention_bias = config.o_proj_bias = k.bias;
    config.num_key_value_heads = k.kv_heads;
    const std::string spec = "streambp:layer_chunk=7,head_chunk=9";
    INFO(c10::toString(k.dtype) << " " << spec << " T=40 B=2 pad=0.2 prompt=0.25 " << describe(config));
    sbp::Model model(config, k.dtype, 7);
    sbp::Model oracle_model(config, at::kDouble, model.parameters(), "low-precision weights");
    const Batch batch = sbp::random_sft_batch(config, {2, 40, 0.2, 0.25, 8});
    const auto oracle = run_step(oracle_model, "standard", batch);
    const auto standard = run_step(model, "standard", batch);
    const auto stream = run_step(model, spec, batch);

    for (const auto& g : stream.gradients) {
      INFO(g.name);
      CHECK(at::isfinite(g.tensor).all().item<bool>());
    }
    const auto standard_error = sbp::compare_gradients(oracle.gradients, standard.gradients);
    const auto stream_error = sbp::compare_gradients(oracle.gradients, stream.gradients);
    REQUIRE(standard_error.problems.empty());
    REQUIRE(stream_error.problems.empty());
    REQUIRE(stream_error.tensors.size() == standard_error.tensors.size());
    const auto verdict = sbp::low_precision_rule(standard_error, stream_error, k.dtype);
    INFO(verdict.worst_tensor << ": streambp " << verdict.method_error << ", standard " << verdict.standard_error
                              << ", ratio to the allowance " << verdict.worst_ratio);
    CHECK(verdict.passed());
  }
}

namespace {

// The low-precision tests' sequence length, and StreamBP's settings at its ends there (its catalogue entry's).
constexpr std::int64_t kRuleSeq = 512;
std::vector<std::string> streambp_edges() { return sbp::streambp_entry().tests.edges(kRuleSeq); }

// Errors of standard BP and of `method` (or the method `spec`) in bf16 against the fp64 oracle on the same bf16
// weights: one entry per parameter tensor.
struct Bf16Errors {
  sbp::GradComparison standard, stream;
};
// `tiny`, untied: the model of every bf16 case but the issue's own.
ModelConfig bf16_config() {
  ModelConfig config = sbp::test::tiny_config();
  config.tie_word_embeddings = false;
  return config;
}
// mixed: bf16 compute with fp32 masters and gradients (--grad-dtype fp32); lora: a LoRA spec (fp64 oracle with the
// same adapters). B = 1, T = 512.
Bf16Errors bf16_errors(sbp::BackpropMethod& method, bool mixed = false, const std::string& lora = "",
                       const ModelConfig& config = bf16_config()) {
  sbp::Model model(config, at::kBFloat16, 17);
  sbp::Model oracle_model(config, at::kDouble, model.parameters(), "bf16 weights");
  if (!lora.empty()) {
    model.add_lora(sbp::parse_lora_spec(lora), 19);  // bf16 adapters: the oracle gets them widened
    oracle_model.load_lora(model.lora(), model.adapters(), "bf16 adapters");
  }
  if (mixed) model.set_grad_dtype(at::kFloat);
  const Batch batch = sbp::random_sft_batch(config, {1, kRuleSeq, 0.0, 0.0, 18});
  const auto oracle = run_step(oracle_model, "standard", batch);
  const auto standard = run_step(model, "standard", batch);
  sbp::SftObjective objective;
  method.step(model, objective, batch);
  return {sbp::compare_gradients(oracle.gradients, standard.gradients),
          sbp::compare_gradients(oracle.gradients, model.gradients())};
}
Bf16Errors bf16_errors(const std::string& spec, bool mixed = false, const std::string& lora = "",
                       const ModelConfig& config = bf16_config()) {
  return bf16_errors(*sbp::make_method(spec), mixed, lora, config);
}

// The harness's low-precision rule (verify/grad_compare.h): StreamBP's error within allowance(n) x standard BP's + the
// rounding floor on every tensor, the allowance 1.5x at large n and wider on tensors of few entries.
sbp::RuleVerdict bf16_verdict(const Bf16Errors& e) { return sbp::low_precision_rule(e.standard, e.stream, at::kBFloat16); }

// The bar checked on one case: every tensor compared, and the rule passed (`what` names the case on failure).
void check_bf16_rule(const Bf16Errors& e, const std::string& what) {
  REQUIRE(e.stream.problems.empty());
  const auto verdict = bf16_verdict(e);
  INFO(what << ": largest error / (allowance x standard + floor) = " << verdict.worst_ratio << " ("
            << verdict.worst_tensor << ": " << verdict.method_error << " vs " << verdict.standard_error << ", allowance "
            << verdict.allowance << ")");
  CHECK(verdict.passed());
}

// The model of issue #18: 4 layers, d = 128, 4 heads of 32 over 2 KV heads, I = 256, V = 512 (untied).
ModelConfig issue18_config() {
  ModelConfig config = bf16_config();
  config.name = "issue18";
  config.hidden_size = 128;
  config.intermediate_size = 256;
  config.num_hidden_layers = 4;
  config.head_dim = 32;
  return config;
}

}  // namespace

TEST_CASE("StreamBP's bf16 error stays within the low-precision rule at any chunk count", "[exactness][streambp][bf16]") {
  // ARCHITECTURE.md §4 "Precision": sums over chunks (dK/dV, weight, LM-head and final-norm gradients) live in fp32 and each
  // is rounded into bf16 once (every chunk's share is itself one bf16 GEMM output). Measured (tiny, T = 512, native bf16 and AVX512_CORE): StreamBP/standard l2 error ratios
  // <= 1.23 per tensor from 1 to 512 chunks, largest on 16- and 64-entry norm weights, whose ratios are the noisiest.
  for (const auto& spec : streambp_edges()) check_bf16_rule(bf16_errors(spec), spec);
}

TEST_CASE("StreamBP through the whole-chunk attention CUDA runs in bf16 stays within the low-precision rule",
          "[exactness][streambp][bf16][whole-chunk]") {
  // On CUDA, bf16 chunk attention is one flash call per chunk whose dK/dV of the prefix come rounded to bf16 (the
  // kernel writes no fp32 gradients) before they enter the fp32 sums: one rounding per chunk that the CPU's fp32
  // blocks do not make. Here that path runs on the CPU through its reference kernel (CPU flash, bf16 in and out,
  // fp32 accumulation, a bottom-right mask); the CUDA kernel's own blocking and rounding order are not this one's,
  // so this bounds the path's arithmetic, not the GPU's numbers (tests/gpu/run.sh checks those). Measured (T = 512,
  // AMD EPYC with avx512_bf16): worst ratios to the allowance 0.72-0.77 from 1 to 512 chunks (norm weights) and
  // 0.74-0.75 on issue #18's model at 64 chunks; the CPU's fp32 blocks on the same cases: 0.70-0.79 and 0.80.
  const sbp::ScopedCpuWholeChunkKernel whole_chunk(sbp::cpu_masked_whole_chunk_kernel());
  for (const auto& spec : streambp_edges()) check_bf16_rule(bf16_errors(spec), spec);
  for (const bool mixed : {false, true}) {
    check_bf16_rule(bf16_errors("streambp:layer_chunk=8,head_chunk=8", mixed, "", issue18_config()),
                    "issue #18's model, 64 chunks, mixed=" + std::to_string(mixed));
  }
}

TEST_CASE("StreamBP's bf16 error stays within the low-precision rule on issue #18's model at 64 chunks",
          "[exactness][streambp][bf16]") {
  // Issue #18 reported 1.85x standard-bf16's l2 error on layer 0's v_proj at 64 layer chunks of 8 tokens, accepted by
  // the former floor u (as large as standard's error, 7.2e-3). Measured here after the fix (B = 1, T = 512, seeds as
  // below, native bf16 and AVX512_CORE): worst per-tensor ratios 1.17-1.25 (full: q_norm; LoRA: o_proj's A), v_proj
  // 0.8; the chunk shares' bf16 roundings before the fix added ~1% (geometric mean over tensors).
  for (const std::string lora : {"", "rank=8,init=random"})
    for (const bool mixed : {false, true}) {
      check_bf16_rule(bf16_errors("streambp:layer_chunk=8,head_chunk=8", mixed, lora, issue18_config()),
                      "lora=" + lora + " mixed=" + std::to_string(mixed));
    }
}

TEST_CASE("checkpoint's and MsT's bf16 errors stay within the low-precision rule at any mini-sequence count",
          "[exactness][bf16][mst]") {
  // Checkpointing re-runs the standard arithmetic; MsT sums its MLP mini-sequences' weight gradients and its head
  // chunks over 1 to 512 mini-sequences of the same T = 512.
  for (const auto& spec : sbp::edge_method_specs(kRuleSeq))
    if (!spec.starts_with("streambp")) check_bf16_rule(bf16_errors(spec), spec);
}

TEST_CASE("in mixed precision every method stays within the low-precision rule at any chunk count",
          "[exactness][bf16][mixed]") {
  // --grad-dtype fp32: bf16 compute, fp32 masters and gradients; full fine-tuning and LoRA (fp32 adapters on the bf16
  // base, the paper's LoRA setting). The fp32 gradients are the streamed sums themselves (no separate buffers), and
  // the chunk shares go into them as in bf16, never rounded per chunk; their error must not grow with the chunk count.
  for (const std::string lora : {"", "rank=8,init=random"})
    for (const auto& spec : sbp::edge_method_specs(kRuleSeq)) {
      check_bf16_rule(bf16_errors(spec, /*mixed=*/true, lora), spec + " lora=" + lora);
    }
}

TEST_CASE("mixed precision runs the bf16 model on fp32 masters", "[exactness][bf16][mixed]") {
  // The forward is the bf16 model's, bit for bit (the masters hold bf16 values here); only the trainable tensors and
  // their gradients are fp32: all weights in full fine-tuning, the adapters under LoRA (the base stays bf16).
  ModelConfig config = sbp::test::tiny_config();
  const Batch batch = sbp::random_sft_batch(config, {2, 40, 0.2, 0.1, 52});
  for (const std::string lora : {"", "rank=4"}) {
    INFO("lora=" << lora);
    sbp::Model bf16(config, at::kBFloat16, 51), mixed(config, at::kBFloat16, 51);
    if (!lora.empty()) {
      bf16.add_lora(sbp::parse_lora_spec(lora + ",init=random"), 53);
      mixed.add_lora(sbp::parse_lora_spec(lora + ",init=random"), 53);
    }
    mixed.set_grad_dtype(at::kFloat);
    CHECK(mixed.grad_dtype() == at::kFloat);
    for (const auto& p : mixed.trainable()) CHECK(p.tensor.scalar_type() == at::kFloat);
    for (const auto& p : mixed.parameters()) CHECK(p.tensor.scalar_type() == (lora.empty() ? at::kFloat : at::kBFloat16));
    for (const std::string spec : {"standard", "streambp:layer_chunk=8,head_chunk=16"}) {
      INFO(spec);
      const auto a = run_step(bf16, spec, batch), b = run_step(mixed, spec, batch);
      CHECK(a.loss == b.loss);
      REQUIRE(a.gradients.size() == b.gradients.size());
      for (const auto& g : b.gradients) CHECK(g.tensor.scalar_type() == at::kFloat);
    }
  }
  sbp::Model fp32(config, at::kFloat, 51), fp64(config, at::kDouble, 51), bf16(config, at::kBFloat16, 51);
  CHECK_THROWS_WITH(fp64.set_grad_dtype(at::kFloat), Catch::Contains("--grad-dtype fp32 with --dtype fp64"));
  CHECK_THROWS_WITH(fp32.set_grad_dtype(at::kBFloat16), Catch::Contains("--grad-dtype bf16 with --dtype fp32"));
  CHECK_THROWS_WITH(bf16.set_grad_dtype(at::kDouble), Catch::Contains("fp32 for a bf16/fp16 model"));
  CHECK_NOTHROW(fp32.set_grad_dtype(at::kFloat));
}

TEST_CASE("the bf16 gate fails when streamed sums are kept in bf16 over many chunks", "[negative-control][bf16]") {
  // The fault rounds dK/dV and every weight gradient once per chunk: 512 chunks of one token. It must trip the rule.
  sbp::test::ModelDtypeSumsStreamBP faulty({/*layer_chunk=*/1, /*head_chunk=*/32});  // tests/support/faulty_methods.h
  const auto e = bf16_errors(faulty);
  const auto verdict = bf16_verdict(e);
  INFO("largest error / (allowance x standard + floor) = " << verdict.worst_ratio << " (" << verdict.worst_tensor
                                                           << ", allowance " << verdict.allowance << ")");
  CHECK_FALSE(verdict.passed());
}

TEST_CASE("every method computes the same loss in fp64", "[exactness][loss]") {
  ModelConfig config = sbp::test::tiny_config();
  config.tie_word_embeddings = false;
  sbp::Model model(config, at::kDouble, 21);
  const Batch batch = sbp::random_sft_batch(config, {3, 29, 0.3, 0.2, 22});
  const double reference = run_step(model, "standard", batch).loss;
  for (const auto& spec : sbp::edge_method_specs(29)) {
    INFO(spec);
    CHECK(relative_difference(reference, run_step(model, spec, batch).loss) <= kLossRtol);
  }
}

TEST_CASE("Repeated StreamBP backward passes are bitwise identical", "[exactness][determinism]") {
  ModelConfig config = sbp::test::tiny_config();
  config.attention_bias = config.o_proj_bias = true;
  for (const auto dtype : {at::kDouble, at::kFloat}) {
    INFO(c10::toString(dtype));
    sbp::Model model(config, dtype, 31);
    const Batch batch = sbp::random_sft_batch(config, {2, 45, 0.2, 0.1, 32});
    const std::string spec = "streambp:layer_chunk=8,head_chunk=5";
    const auto first = run_step(model, spec, batch);
    const auto second = run_step(model, spec, batch);
    CHECK(first.loss == second.loss);
    REQUIRE(first.gradients.size() == second.gradients.size());
    for (std::size_t i = 0; i < first.gradients.size(); ++i) {
      INFO(first.gradients[i].name);
      CHECK(first.gradients[i].name == second.gradients[i].name);
      CHECK(at::equal(first.gradients[i].tensor, second.gradients[i].tensor));
    }
  }
}
