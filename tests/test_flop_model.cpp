// The FLOP model's matrix products against the products each method really executes, counted op by op through
// ATen's RecordFunction callbacks (mm, addmm, bmm, baddbmm with their input shapes). Attention runs in the flash
// kernels, which are not matrix-product ops: the counter sees the projections and the LM head, exactly what the
// model's non-attention terms claim.
#include <catch2/catch.hpp>

#include <atomic>
#include <cmath>
#include <set>

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include "baselines/methods.h"
#include "core/methods/flop_model.h"
#include "core/model/lora.h"
#include "core/model/model.h"
#include "core/objectives/sft.h"
#include "experiments/runner.h"
#include "test_support.h"

namespace {

std::atomic<double> g_counted{0};

// Counts 2·m·k·n per product while alive.
class MatmulCounter {
 public:
  MatmulCounter() {
    g_counted = 0;
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(&MatmulCounter::enter).needsInputs(true));
  }
  ~MatmulCounter() { at::removeCallback(handle_); }
  double flops() const { return g_counted; }

 private:
  static std::unique_ptr<at::ObserverContext> enter(const at::RecordFunction& fn) {
    static const std::set<std::string> two_d = {"aten::mm", "aten::addmm", "aten::addmm_"};
    static const std::set<std::string> batched = {"aten::bmm", "aten::baddbmm", "aten::baddbmm_"};
    const std::string name = fn.name();
    const bool is_2d = two_d.count(name) > 0, is_batched = batched.count(name) > 0;
    if (!is_2d && !is_batched) return nullptr;
    const auto inputs = fn.inputs();
    // mm(a, b); addmm(bias, a, b); bmm(a, b); baddbmm(bias, a, b)
    const std::size_t first = name == "aten::mm" || name == "aten::bmm" ? 0 : 1;
    const auto a = inputs[first].toTensor().sizes(), b = inputs[first + 1].toTensor().sizes();
    double f = 2.0 * double(a[a.size() - 2]) * double(a[a.size() - 1]) * double(b[b.size() - 1]);
    if (is_batched) f *= double(a[0]);
    g_counted = g_counted + f;
    return nullptr;
  }
  at::CallbackHandle handle_;
};

}  // namespace

TEST_CASE("the FLOP model's projections and LM head are the matrix products each method executes",
          "[flops]") {
  sbp::ModelConfig config = sbp::test::tiny_config();
  config.tie_word_embeddings = false;
  for (const std::string lora : {"", "rank=4"})
    for (const std::string spec : {"standard", "checkpoint", "mst:mini_seq=16", "streambp:layer_chunk=16,head_chunk=32"}) {
      sbp::Model model(config, at::kFloat, 3);
      if (!lora.empty()) model.add_lora(sbp::parse_lora_spec(lora), 4);
      const auto batch = sbp::random_sft_batch(config, {2, 64, 0.0, 0.0, 5});
      sbp::SftObjective objective;
      auto method = sbp::make_method(spec);
      objective.prepare(batch, config);
      const auto workload = sbp::make_workload(model, objective, batch);
      double counted = 0;
      {
        MatmulCounter counter;
        method->step(model, objective, batch);
        counted = counter.flops();
      }
      // The model minus its attention terms (what the flash kernels compute).
      const auto f = sbp::flop_terms(workload);
      const auto name = method->spec().substr(0, method->spec().find(':'));
      const double attention = name == "streambp" ? sbp::streambp_attention_flops(workload, 16)
                               : f.attention * (name == "standard" ? 1 + sbp::FlopTerms::kAttentionBackward
                                                                  : 2 + sbp::FlopTerms::kAttentionBackward);
      const double expected = method->flops(workload) - attention;
      INFO(spec << " lora=" << lora << ": counted - model = " << counted - expected);
      CHECK(std::abs(counted / expected - 1) < 1e-9);
    }
}
