// The FLOP model against the work each method really executes, counted op by op through ATen's RecordFunction
// callbacks: matrix products (mm, addmm, bmm, baddbmm with their input shapes) and the attention kernels' calls (ATen's
// CPU flash forward and backward, which standard BP's SDPA and every chunk_attention path end in on the CPU). An
// attention call is counted by the query-key pairs its contract scores, read from its arguments: q's and k's shapes,
// is_causal (top-left on the call's own [c, n] scores) and the additive mask (finite entries). Two products of
// head_dim per pair forward (S = QKᵀ, O = PV); five backward, as ATen's cpu_flash_attention_backward runs per tile (S
// recomputed, dV = PᵀdO, dP = dO Vᵀ, dQ = dS K, dK = dSᵀQ), which is where FlopTerms::kAttentionBackward = 2.5 comes
// from: the test counts the pairs of every backward call, the 5/2 is read from that source, not measured. A kernel's
// arithmetic beyond its pairs (ATen computes whole tiles along the diagonal and masks them) is a tile-size detail of
// one build, not part of the model.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include "baselines/methods.h"
#include "core/methods/flop_model.h"
#include "core/methods/phase.h"
#include "core/methods/streaming.h"
#include "core/methods/streambp.h"
#include "core/model/chunk_attention_kernels.h"
#include "core/model/lora.h"
#include "core/model/model.h"
#include "core/objectives/packed_batch.h"
#include "core/objectives/sft.h"
#include "experiments/batches.h"
#include "tests/support/test_support.h"

namespace {

std::atomic<double> g_matmul{0}, g_attention_forward{0}, g_attention_backward{0};

// Pairs (query i, key j) an attention call scores, summed over batch and query heads: q [B, H, c, hd], k [B, Hkv, n,
// hd]; is_causal: ATen's top-left rule, query i sees keys j <= i; a mask [.., c, n]: its finite entries.
double attention_pairs(const at::Tensor& q, const at::Tensor& k, bool causal, const c10::IValue& mask) {
  const double rows = double(q.size(0)) * double(q.size(1));
  const std::int64_t c = q.size(2), n = k.size(2);
  if (mask.isTensor() && mask.toTensor().defined()) {
    const auto m = mask.toTensor();
    TORCH_CHECK(m.dim() == 2, "attention counter: a per-row mask was not expected");
    at::DisableRecordFunctionGuard no_recursion;  // the count's own ops are not the step's work
    return rows * double(at::isfinite(m).sum().item<std::int64_t>());
  }
  if (!causal) return rows * double(c) * double(n);
  double pairs = 0;
  for (std::int64_t i = 0; i < c; ++i) pairs += double(std::min(i + 1, n));
  return rows * pairs;
}

// While alive, counts 2·m·k·n per matrix product, and 2·hd FLOPs per product per attention pair (2 products
// forward, 5 backward).
class WorkCounter {
 public:
  WorkCounter() {
    g_matmul = g_attention_forward = g_attention_backward = 0;
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(&WorkCounter::enter).needsInputs(true));
  }
  ~WorkCounter() { at::removeCallback(handle_); }
  double matmul_flops() const { return g_matmul; }
  double attention_forward_flops() const { return g_attention_forward; }
  double attention_backward_flops() const { return g_attention_backward; }

 private:
  static std::unique_ptr<at::ObserverContext> enter(const at::RecordFunction& fn) {
    static const std::set<std::string> two_d = {"aten::mm", "aten::addmm", "aten::addmm_"};
    static const std::set<std::string> batched = {"aten::bmm", "aten::baddbmm", "aten::baddbmm_"};
    const std::string name = fn.name();
    const auto inputs = fn.inputs();
    if (name == "aten::_scaled_dot_product_flash_attention_for_cpu") {
      // (query, key, value, dropout_p, is_causal, attn_mask, scale)
      const auto& q = inputs[0].toTensor();
      g_attention_forward = g_attention_forward + 2 * 2.0 * double(q.size(3)) *
                                                      attention_pairs(q, inputs[1].toTensor(), inputs[4].toBool(), inputs[5]);
      return nullptr;
    }
    if (name == "aten::_scaled_dot_product_flash_attention_for_cpu_backward") {
      // (grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask, scale)
      const auto& q = inputs[1].toTensor();
      g_attention_backward = g_attention_backward + 5 * 2.0 * double(q.size(3)) *
                                                        attention_pairs(q, inputs[2].toTensor(), inputs[7].toBool(), inputs[8]);
      return nullptr;
    }
    const bool is_2d = two_d.count(name) > 0, is_batched = batched.count(name) > 0;
    if (!is_2d && !is_batched) return nullptr;
    // mm(a, b); addmm(bias, a, b); bmm(a, b); baddbmm(bias, a, b)
    const std::size_t first = name == "aten::mm" || name == "aten::bmm" ? 0 : 1;
    const auto a = inputs[first].toTensor().sizes(), b = inputs[first + 1].toTensor().sizes();
    double f = 2.0 * double(a[a.size() - 2]) * double(a[a.size() - 1]) * double(b[b.size() - 1]);
    if (is_batched) f *= double(a[0]);
    g_matmul = g_matmul + f;
    return nullptr;
  }
  at::CallbackHandle handle_;
};

double relative_gap(double a, double b) { return std::abs(a / b - 1); }

}  // namespace

TEST_CASE("the FLOP model is the matrix products and attention pairs each method executes", "[flops]") {
  sbp::ModelConfig config = sbp::test::tiny_config();
  config.tie_word_embeddings = false;
  constexpr std::int64_t T = 64;
  // StreamBP's typical setting (its catalogue entry's): chunks that do not divide T, the last one short.
  const std::string streambp = sbp::streambp_entry().tests.typical(T);
  const auto layer_chunk = dynamic_cast<const sbp::StreamBP&>(*sbp::make_method(streambp)).options().layer_chunk;
  REQUIRE(T % layer_chunk != 0);
  struct Case {
    std::string lora, spec;
    at::ScalarType dtype;
  };
  std::vector<Case> cases;
  for (const std::string lora : {"", "rank=4"})
    for (const auto& spec : sbp::typical_method_specs(T))
      cases.push_back({lora, spec, at::kFloat});
  // bf16 on the CPU with the whole-chunk kernel of CUDA's bf16 path (one call over [0, s+c) per chunk with a
  // bottom-right mask) in place of the blocks: the same pairs by another route.
  cases.push_back({"", streambp, at::kBFloat16});
  for (const auto& [lora, spec, dtype] : cases) {
    std::optional<sbp::ScopedCpuWholeChunkKernel> whole_chunk;
    if (dtype == at::kBFloat16) whole_chunk.emplace(sbp::cpu_masked_whole_chunk_kernel());
    sbp::Model model(config, dtype, 3);
    if (!lora.empty()) model.add_lora(sbp::parse_lora_spec(lora), 4);
    const auto batch = sbp::random_sft_batch(config, {2, T, 0.0, 0.0, 5});
    sbp::SftObjective objective;
    auto method = sbp::make_method(spec);
    const auto workload = sbp::make_workload(model, objective.prepare(batch, config), batch);
    double matmul = 0, attention_forward = 0, attention_backward = 0;
    {
      WorkCounter counter;
      method->step(model, objective, batch);
      matmul = counter.matmul_flops();
      attention_forward = counter.attention_forward_flops();
      attention_backward = counter.attention_backward_flops();
    }
    const auto f = sbp::flop_terms(workload);
    const auto name = method->spec().substr(0, method->spec().find(':'));
    // Causal forwards of every layer's attention: one for standard BP, two (forward + re-forward) for the others.
    // StreamBP's chunks (a prefix block and a causal diagonal block, or one bottom-right masked call) cover the
    // causal triangle's rows once per pass, whatever the chunk size.
    const double forwards = name == "standard" ? 1 : 2;
    INFO(spec << " lora=" << lora << " dtype=" << c10::toString(dtype) << ": attention forward counted "
              << attention_forward << ", model " << forwards * f.attention << "; backward counted "
              << attention_backward << ", model " << f.attention * sbp::FlopTerms::kAttentionBackward);
    CHECK(relative_gap(attention_forward, forwards * f.attention) < 1e-12);
    CHECK(relative_gap(attention_backward, f.attention * sbp::FlopTerms::kAttentionBackward) < 1e-12);
    if (name == "streambp")
      CHECK(relative_gap(attention_forward + attention_backward, sbp::streambp_attention_flops(workload)) <
            1e-12);
    const double counted = matmul + attention_forward + attention_backward;
    INFO("counted - model = " << counted - method->flops(workload));
    CHECK(relative_gap(counted, method->flops(workload)) < 1e-9);

    // Negative controls: the comparison resolves one pair per head and query. A causal term of T²/2 pairs (the
    // diagonal's T pairs per head missing), and, for StreamBP, the earlier chunk-square term (each chunk's diagonal
    // block scored in full: Σ c·(s + c) = T²(1 + 1/D)/2 pairs), are both rejected.
    const double half_square = f.attention * T / (T + 1);
    CHECK(relative_gap(attention_forward, forwards * half_square) > 1e-3);
    if (name == "streambp") {
      const double D = double((T + layer_chunk - 1) / layer_chunk), c = double(layer_chunk);
      const double chunk_square = f.attention * std::min(double(T * T), c * c * D * (D + 1) / 2) / (T * (T + 1) / 2.0);
      CHECK(relative_gap(attention_forward + attention_backward,
                     chunk_square * (2 + sbp::FlopTerms::kAttentionBackward)) > 1e-3);
    }
  }
}

TEST_CASE("the FLOP model counts each packed sequence causal triangle and not the whole row", "[flops][packed]") {
  // Two rows of 48 packed as test_packed_exactness.cpp packs them (a sequence of one token, sequences across chunk
  // boundaries): every method's counted attention pairs are Σ L(L+1)/2 over the sequences, and the whole step's FLOPs
  // the model's. Negative control: the same workload blind to its boundaries (B·T(T+1)/2 pairs) misses the count.
  const sbp::ModelConfig config = sbp::test::tiny_config();
  const std::vector<std::vector<std::int64_t>> lengths = {{5, 1, 6, 12, 9, 3, 12}, {30, 2, 16}};
  constexpr std::int64_t T = 48;
  for (const auto& spec : sbp::typical_method_specs(T)) {
    sbp::Model model(config, at::kFloat, 3);
    const auto batch = sbp::packed_sft_batch(config, lengths, 0.0, 5);
    sbp::SftObjective objective;
    auto method = sbp::make_method(spec);
    auto workload = sbp::make_workload(model, objective.prepare(batch, config), batch);
    REQUIRE(workload.packed);
    double matmul = 0, attention = 0;
    {
      WorkCounter counter;
      method->step(model, objective, batch);
      matmul = counter.matmul_flops();
      attention = counter.attention_forward_flops() + counter.attention_backward_flops();
    }
    const auto f = sbp::flop_terms(workload);
    const double pairs = (15 + 1 + 21 + 78 + 45 + 6 + 78) + (465 + 3 + 136);  // Σ L(L+1)/2 of each row
    REQUIRE(workload.packed->causal_pairs() == pairs);
    const double counted = matmul + attention;
    INFO(spec << ": counted " << counted << ", model " << method->flops(workload) << "; attention counted " << attention
              << ", one causal pass " << f.attention);
    CHECK(relative_gap(counted, method->flops(workload)) < 1e-9);
    auto blind = workload;
    blind.packed.reset();
    CHECK(relative_gap(counted, method->flops(blind)) > 1e-3);
  }
}

TEST_CASE("StreamBP's FLOP model of one layer's backward is the work between two layers' gradient events",
          "[flops][disk]") {
  // The disk tier's stall factor (project --disk-bytes-per-node) times a layer's checkpoint read against the work
  // of that layer's backward: steps 1-3 of ARCHITECTURE.md §4, from the event of the layer after it (or the head's)
  // to its own. Counted op by op as above, layer by layer; full training and LoRA.
  sbp::ModelConfig config = sbp::test::tiny_config();
  constexpr std::int64_t T = 64;
  const std::string spec = sbp::streambp_entry().tests.typical(T);
  for (const std::string lora : {"", "rank=4"}) {
    sbp::Model model(config, at::kFloat, 3);
    if (!lora.empty()) model.add_lora(sbp::parse_lora_spec(lora), 4);
    const auto batch = sbp::random_sft_batch(config, {2, T, 0.0, 0.0, 5});
    sbp::SftObjective objective;
    auto method = sbp::make_method(spec);
    const auto workload = sbp::make_workload(model, objective.prepare(batch, config), batch);
    std::vector<std::pair<std::string, double>> events;  // the work counted when each group's gradients were ready
    {
      WorkCounter counter;
      const auto total = [&] {
        return counter.matmul_flops() + counter.attention_forward_flops() + counter.attention_backward_flops();
      };
      auto subscription =
          method->on_gradient_ready([&](const sbp::GradientGroup& g) { events.push_back({g.name, total()}); });
      method->step(model, objective, batch);
    }
    model.zero_grad();
    const double modelled = sbp::streambp_layer_backward_flops(workload);
    const auto f = sbp::flop_terms(workload);
    const double without_reforward = modelled - f.attention / double(config.num_hidden_layers);
    int layers = 0;
    // Under LoRA the head has no trainable tensor and so no event: the last layer's backward has no start there.
    for (std::size_t i = 1; i < events.size(); ++i) {
      if (events[i].first.rfind("layer.", 0) != 0) continue;
      const double counted = events[i].second - events[i - 1].second;
      INFO("lora=" << lora << " " << events[i - 1].first << " -> " << events[i].first << ": counted " << counted
                   << ", model " << modelled);
      CHECK(relative_gap(counted, modelled) < 1e-9);
      CHECK(relative_gap(counted, without_reforward) > 1e-3);  // negative control: attention's re-forward left out
      ++layers;
    }
    CHECK(layers == config.num_hidden_layers - (lora.empty() ? 0 : 1));
  }
}

namespace {

// The work counted inside each phase of a step, by the phase marks the method makes (core/methods/phase.h).
class PhaseWork final : public sbp::PhaseListener {
 public:
  explicit PhaseWork(const WorkCounter& counter) : counter_(counter) { sbp::set_phase_listener(this); }
  ~PhaseWork() override { sbp::set_phase_listener(nullptr); }
  void enter_phase(const std::string&) override { start_ = total(); }
  void leave_phase(const std::string& name) override { work[name] += total() - start_; }
  std::map<std::string, double> work;

 private:
  double total() const {
    return counter_.matmul_flops() + counter_.attention_forward_flops() + counter_.attention_backward_flops();
  }
  const WorkCounter& counter_;
  double start_ = 0;
};

}  // namespace

TEST_CASE("StreamBP's FLOPs by phase are the work each of its phases executes", "[flops]") {
  // `run` prints each phase's achieved rate from these (the phase profile's per-phase share of the GEMM rate), so
  // each must be its phase's own work: counted op by op as above, between the phase marks; full training, LoRA, and
  // DPO, whose head chunks need the statistics pass.
  sbp::ModelConfig config = sbp::test::tiny_config();
  constexpr std::int64_t T = 64;
  const std::string typical = sbp::streambp_entry().tests.typical(T);
  // DPO again with one head chunk of the whole sequence: streamed_head skips the statistics pass there.
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"sft", typical}, {"sft+lora", typical}, {"dpo", typical}, {"dpo", "streambp:layer_chunk=24,head_chunk=64"}};
  for (const auto& [objective_spec, spec] : cases) {
    sbp::Model model(config, at::kFloat, 3);
    if (objective_spec == "sft+lora") model.add_lora(sbp::parse_lora_spec("rank=4"), 4);
    std::unique_ptr<sbp::Objective> objective = sbp::make_objective(objective_spec == "dpo" ? "dpo" : "sft");
    auto batch = objective->random_batch(config, {2, T, 0.0, 0.0, 5});
    if (objective_spec == "dpo")  // the reference's log-probs, before the count (the model's own: any will do)
      batch = objective->with_reference(batch, sbp::sequence_logps(model, batch, 1.0));
    auto method = sbp::make_method(spec);
    const auto workload = sbp::make_workload(model, objective->prepare(batch, config), batch);
    std::map<std::string, double> counted;
    {
      WorkCounter counter;
      PhaseWork phases(counter);
      method->step(model, *objective, batch);
      counted = phases.work;
    }
    model.zero_grad();
    const auto modelled = method->phase_flops(workload);
    double sum = 0;
    for (const auto& [name, flops] : modelled) {
      INFO(objective_spec << " phase " << name << ": counted " << counted[name] << ", model " << flops);
      CHECK((flops == 0 ? counted[name] == 0 : relative_gap(counted[name], flops) < 1e-9));
      sum += flops;
    }
    CHECK(relative_gap(sum, method->flops(workload)) < 1e-12);
    const bool statistics = objective_spec == "dpo" && spec == typical;
    INFO(objective_spec << " " << spec);
    CHECK((counted["statistics"] > 0) == statistics);
    CHECK((modelled[1].flops > 0) == statistics);  // negative control of the case: the pass modelled where it runs
    for (const auto& phase : counted)  // every phase that computes has its FLOPs modelled
      CHECK((phase.second == 0 || std::any_of(modelled.begin(), modelled.end(),
                                              [&](const sbp::PhaseFlops& p) { return p.name == phase.first; })));
    // Negative control: step 2's attention re-forward counted in the forward phase instead is seen.
    const auto f = sbp::flop_terms(workload);
    CHECK(relative_gap(counted["forward"], modelled[0].flops + f.attention) > 1e-3);
  }
}
