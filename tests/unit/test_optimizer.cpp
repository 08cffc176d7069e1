// The optimizer pieces of a training step (ARCHITECTURE.md §11): specs, AdamW and SGD against their textbook updates in fp64,
// resuming bit for bit, gradient clipping, HF's lr schedules, and the step's temporaries against the CPU meter.
// Bitwise equality with torch.optim itself is tests/oracle/optimizer_oracle.py's claim (it needs Python).
#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <numbers>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "core/training/lr_schedule.h"
#include "core/training/optimizer.h"
#include "profiler/cpu_meter.h"
#include "tests/support/test_support.h"

using Catch::Contains;
using sbp::Optimizer;
using sbp::OptimizerOptions;
using sbp::TensorList;

namespace {

// The textbook updates below and torch's arrangement of the same arithmetic round differently, by an ulp or two of
// the parameters (|p| <= 1.1). Measured worst over these 6 steps: 3.3e-16 (AdamW), 5.6e-17 (SGD); without bias
// correction (the negative control) 0.24.
constexpr double kTextbookTol = 1e-15;

struct OptimizerCase {
  TensorList params;  // fp64 leaves
  std::vector<std::map<std::string, at::Tensor>> grads;  // per step; a missing name = no gradient that step
  std::vector<double> lrs;
};

// Three tensors (a weight, a bias and a norm weight, so that HF's decay groups matter), 6 steps of gradients, the
// bias without a gradient at step 2, a learning rate that changes every step.
OptimizerCase make_case(at::ScalarType dtype = at::kDouble, std::uint64_t seed = 7) {
  const auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const std::vector<std::pair<std::string, std::vector<std::int64_t>>> shapes = {
      {"model.layers.0.mlp.up_proj.weight", {4, 5}}, {"model.layers.0.mlp.up_proj.bias", {4}},
      {"model.layers.0.input_layernorm.weight", {7}}};
  OptimizerCase c;
  for (const auto& [name, shape] : shapes)
    c.params.push_back({name, (at::rand(shape, gen, at::kDouble) * 2 - 1).to(dtype).requires_grad_(true)});
  for (int k = 0; k < 6; ++k) {
    auto& step = c.grads.emplace_back();
    for (const auto& [name, shape] : shapes)
      if (!(k == 2 && name.ends_with("bias"))) step[name] = (at::randn(shape, gen, at::kDouble) * 0.1).to(dtype);
    c.lrs.push_back(1e-2 * (1.0 + 0.1 * k));
  }
  return c;
}

void set_grads(const TensorList& params, const std::map<std::string, at::Tensor>& grads) {
  for (const auto& [name, p] : params) {
    const auto it = grads.find(name);
    p.mutable_grad() = it == grads.end() ? at::Tensor() : it->second.clone();
  }
}

TensorList clone(const TensorList& params) {
  TensorList out;
  for (const auto& [name, p] : params) out.push_back({name, p.detach().clone().requires_grad_(true)});
  return out;
}

// Runs `steps` steps of `c` from step `first` on.
void run_steps(Optimizer& optimizer, const OptimizerCase& c, const TensorList& params, int first, int steps) {
  for (int k = first; k < first + steps; ++k) {
    set_grads(params, c.grads[k]);
    optimizer.step(c.lrs[k]);
  }
}

// Element by element in double, from the papers: AdamW (Loshchilov & Hutter, decoupled decay scaled by lr, as
// torch does) and SGD with momentum (torch's form, dampening 0). `bias_correction` false is the negative control.
struct Textbook {
  OptimizerOptions o;
  bool bias_correction = true;
  std::map<std::string, std::vector<double>> p, m, v;
  std::map<std::string, int> t;

  void step(const OptimizerCase& c, int k) {
    for (const auto& [name, param] : c.params) {
      const auto it = c.grads[k].find(name);
      if (it == c.grads[k].end()) continue;
      const auto g = it->second.contiguous();
      auto& p = this->p[name];
      auto& m = this->m[name];
      auto& v = this->v[name];
      m.resize(p.size(), 0.0);
      v.resize(p.size(), 0.0);
      const int t = ++this->t[name];
      const double wd = sbp::decays_weight(o, name) ? o.weight_decay : 0.0, lr = c.lrs[k];
      for (std::size_t i = 0; i < p.size(); ++i) {
        const double gi = g.data_ptr<double>()[i];
        if (o.kind == sbp::OptimizerKind::AdamW) {
          p[i] -= lr * wd * p[i];
          m[i] = o.beta1 * m[i] + (1 - o.beta1) * gi;
          v[i] = o.beta2 * v[i] + (1 - o.beta2) * gi * gi;
          const double m_hat = bias_correction ? m[i] / (1 - std::pow(o.beta1, t)) : m[i];
          const double v_hat = bias_correction ? v[i] / (1 - std::pow(o.beta2, t)) : v[i];
          p[i] -= lr * m_hat / (std::sqrt(v_hat) + o.eps);
        } else {
          const double d = gi + wd * p[i];
          m[i] = t == 1 ? d : o.momentum * m[i] + d;
          p[i] -= lr * m[i];
        }
      }
    }
  }
};

Textbook start(const OptimizerOptions& o, const OptimizerCase& c) {
  Textbook ref{o};
  for (const auto& [name, p] : c.params) {
    const auto flat = p.detach().contiguous();
    ref.p[name].assign(flat.data_ptr<double>(), flat.data_ptr<double>() + flat.numel());
  }
  return ref;
}

double max_error(const TensorList& params, const Textbook& ref) {
  double worst = 0;
  for (const auto& [name, p] : params) {
    const auto flat = p.detach().contiguous();
    for (std::int64_t i = 0; i < flat.numel(); ++i)
      worst = std::max(worst, std::abs(flat.data_ptr<double>()[i] - ref.p.at(name)[i]));
  }
  return worst;
}

// Ours and the textbook's over the whole case; returns the worst |difference| of the parameters.
double textbook_error(const OptimizerOptions& o, bool bias_correction = true) {
  const OptimizerCase c = make_case();
  Textbook ref = start(o, c);
  ref.bias_correction = bias_correction;
  Optimizer optimizer(c.params, o);
  for (int k = 0; k < int(c.grads.size()); ++k) {
    run_steps(optimizer, c, c.params, k, 1);
    ref.step(c, k);
  }
  return max_error(c.params, ref);
}

void require_bitwise_equal(const TensorList& a, const TensorList& b) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].name);
    CHECK(a[i].name == b[i].name);
    CHECK(at::equal(a[i].tensor, b[i].tensor));
  }
}

}  // namespace

TEST_CASE("optimizer specs round-trip through their canonical text", "[optimizer][spec]") {
  const auto adamw =
      sbp::parse_optimizer_spec("adamw:lr=1e-3,beta1=0.9,beta2=0.95,eps=1e-8,weight_decay=0.01,"
                                "decay_norms_and_biases=0");
  CHECK(adamw.kind == sbp::OptimizerKind::AdamW);
  CHECK(adamw.lr == 1e-3);
  CHECK(adamw.beta2 == 0.95);
  CHECK(adamw.weight_decay == 0.01);
  CHECK_FALSE(adamw.decay_norms_and_biases);
  const auto text = sbp::optimizer_spec(adamw);
  CHECK(text == "adamw:lr=0.001,beta1=0.9,beta2=0.95,eps=1e-08,weight_decay=0.01,decay_norms_and_biases=0");
  CHECK(sbp::optimizer_spec(sbp::parse_optimizer_spec(text)) == text);

  const auto defaults = sbp::parse_optimizer_spec("adamw");
  CHECK(sbp::optimizer_spec(defaults) == sbp::optimizer_spec(OptimizerOptions{}));
  CHECK(sbp::optimizer_spec(defaults) == "adamw:lr=1e-05,beta1=0.9,beta2=0.999,eps=1e-08,weight_decay=0,"
                                         "decay_norms_and_biases=1");

  const auto sgd = sbp::parse_optimizer_spec("sgd:lr=0.1,momentum=0.9,weight_decay=0");
  CHECK(sgd.kind == sbp::OptimizerKind::Sgd);
  CHECK(sgd.momentum == 0.9);
  CHECK(sbp::optimizer_spec(sgd) == "sgd:lr=0.1,momentum=0.9,weight_decay=0,decay_norms_and_biases=1");
  // A number that needs all 17 digits survives the trip.
  OptimizerOptions odd;
  odd.lr = 0.1 + 0.2;
  CHECK(sbp::parse_optimizer_spec(sbp::optimizer_spec(odd)).lr == odd.lr);

  CHECK(sbp::parse_state_dtype("bf16") == at::kBFloat16);
  CHECK(sbp::parse_state_dtype("fp32") == at::kFloat);
  CHECK(sbp::parse_state_dtype("fp64") == at::kDouble);
}

TEST_CASE("optimizer specs name the unknown kind, key or bad value", "[optimizer][spec]") {
  CHECK_THROWS_WITH(sbp::parse_optimizer_spec("adam:lr=1e-3"), Contains("unknown optimizer 'adam'"));
  CHECK_THROWS_WITH(sbp::parse_optimizer_spec("adamw:momentum=0.9"), Contains("unknown option 'momentum'"));
  CHECK_THROWS_WITH(sbp::parse_optimizer_spec("sgd:beta1=0.9"), Contains("unknown option 'beta1'"));
  CHECK_THROWS_WITH(sbp::parse_optimizer_spec("adamw:lr=fast"), Contains("lr=fast"));
  CHECK_THROWS_WITH(sbp::parse_optimizer_spec("adamw:beta2=1"), Contains("beta2=1"));
  CHECK_THROWS_WITH(sbp::parse_optimizer_spec("sgd:lr=-0.1"), Contains("lr=-0.1"));
  CHECK_THROWS_WITH(sbp::parse_optimizer_spec("adamw:decay_norms_and_biases=yes"),
                    Contains("decay_norms_and_biases=yes"));
  CHECK_THROWS_WITH(sbp::parse_optimizer_spec("adamw:lr"), Contains("expected key=value"));
  CHECK_THROWS_WITH(sbp::parse_state_dtype("fp16"), Contains("'fp16'"));
  // The kind is typed (parse_optimizer_spec refuses "lion" above); options built in code are checked too.
  OptimizerOptions bad;
  bad.momentum = 0.9;
  CHECK_THROWS_WITH(Optimizer({}, bad), Contains("optimizer 'adamw': momentum is an SGD option"));
}

TEST_CASE("HF Trainer's weight-decay groups leave out biases and norm weights by name", "[optimizer]") {
  OptimizerOptions o;
  o.weight_decay = 0.1;
  o.decay_norms_and_biases = false;
  CHECK(sbp::decays_weight(o, "model.layers.0.self_attn.q_proj.weight"));
  CHECK(sbp::decays_weight(o, "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"));
  CHECK(sbp::decays_weight(o, "model.embed_tokens.weight"));
  CHECK_FALSE(sbp::decays_weight(o, "model.layers.0.self_attn.q_proj.bias"));
  CHECK_FALSE(sbp::decays_weight(o, "model.layers.0.input_layernorm.weight"));
  CHECK_FALSE(sbp::decays_weight(o, "model.layers.0.post_attention_layernorm.weight"));
  CHECK_FALSE(sbp::decays_weight(o, "model.layers.0.self_attn.q_norm.weight"));
  CHECK_FALSE(sbp::decays_weight(o, "model.norm.weight"));
  CHECK_FALSE(sbp::decays_weight(o, "Model.RMSNorm.weight"));  // patterns match the lower-cased name
  // HF's patterns need "norm" as a whole component or a "_norm" suffix: "normalizer" decays.
  CHECK(sbp::decays_weight(o, "model.normalizer.weight"));
  o.decay_norms_and_biases = true;
  CHECK(sbp::decays_weight(o, "model.norm.weight"));
  o.weight_decay = 0;
  CHECK_FALSE(sbp::decays_weight(o, "model.layers.0.self_attn.q_proj.weight"));
}

TEST_CASE("AdamW equals the textbook update in fp64 over 6 steps", "[optimizer]") {
  OptimizerOptions o;
  o.lr = 1e-2;  // the case's lrs override it; kept for the spec's sake
  o.weight_decay = 0.1;
  o.decay_norms_and_biases = false;
  const double error = textbook_error(o);
  INFO("max |ours - textbook| = " << error);
  CHECK(error <= kTextbookTol);
  o.decay_norms_and_biases = true;
  o.beta1 = 0.8;
  o.beta2 = 0.99;
  o.eps = 1e-6;
  CHECK(textbook_error(o) <= kTextbookTol);
}

TEST_CASE("SGD with momentum and coupled weight decay equals the textbook update in fp64 over 6 steps",
          "[optimizer]") {
  OptimizerOptions o;
  o.kind = sbp::OptimizerKind::Sgd;
  o.momentum = 0.9;
  o.weight_decay = 0.1;
  const double error = textbook_error(o);
  INFO("max |ours - textbook| = " << error);
  CHECK(error <= kTextbookTol);
  o.momentum = 0;
  o.weight_decay = 0;
  CHECK(textbook_error(o) <= kTextbookTol);
}

TEST_CASE("the textbook comparison rejects AdamW without bias correction", "[optimizer][negative-control]") {
  OptimizerOptions o;
  o.weight_decay = 0.1;
  const double error = textbook_error(o, /*bias_correction=*/false);
  INFO("max |ours - textbook without bias correction| = " << error);
  CHECK(error > 1e6 * kTextbookTol);
}

TEST_CASE("an optimizer resumed from its saved state continues bit for bit", "[optimizer][checkpoint]") {
  struct Config {
    const char* spec;
    at::ScalarType dtype, state_dtype;
  };
  for (const Config& config : {Config{"adamw:lr=1e-2,weight_decay=0.1,decay_norms_and_biases=0", at::kFloat,
                                      at::ScalarType::Undefined},
                               Config{"adamw:lr=1e-2,weight_decay=0.1", at::kBFloat16, at::kFloat},
                               Config{"sgd:lr=0.1,momentum=0.9,weight_decay=0.01", at::kBFloat16,
                                      at::ScalarType::Undefined},
                               Config{"sgd:lr=0.1,momentum=0.9", at::kDouble, at::kFloat}}) {
    INFO(config.spec << " on " << c10::toString(config.dtype) << " parameters");
    OptimizerOptions o = sbp::parse_optimizer_spec(config.spec);
    o.state_dtype = config.state_dtype;
    const OptimizerCase c = make_case(config.dtype);
    const TensorList whole = clone(c.params), resumed = clone(c.params);
    Optimizer uninterrupted(whole, o);
    run_steps(uninterrupted, c, whole, 0, 6);

    sbp::test::TempDir dir("sbp_test_optimizer_");
    const auto file = dir.path() / "optimizer.safetensors";
    {
      Optimizer first(resumed, o);
      run_steps(first, c, resumed, 0, 3);  // the bias has missed a gradient: its step count lags
      sbp::save_optimizer_state(first, file);
    }
    Optimizer second(resumed, o);
    sbp::load_optimizer_state(second, file);
    CHECK(second.steps_taken() == 3);
    run_steps(second, c, resumed, 3, 3);
    CHECK(second.steps_taken() == uninterrupted.steps_taken());
    require_bitwise_equal(resumed, whole);
    require_bitwise_equal(second.state(), uninterrupted.state());
  }
}

TEST_CASE("bf16 parameters with fp32 optimizer states take the fp32 update and are rounded once per step",
          "[optimizer]") {
  for (const char* spec : {"adamw:lr=1e-2,weight_decay=0.1", "sgd:lr=0.1,momentum=0.9,weight_decay=0.01"}) {
    INFO(spec);
    OptimizerOptions mixed = sbp::parse_optimizer_spec(spec);
    mixed.state_dtype = at::kFloat;
    const OptimizerCase c = make_case(at::kBFloat16);
    Optimizer ours(c.params, mixed);
    // The reference is torch's own path in fp32 over fp32 copies that are re-read from the rounded bf16 values
    // before every step (there is no master copy: each step starts from the bf16 parameter).
    TensorList rounded = clone(c.params), fp32;
    for (const auto& [name, p] : c.params) fp32.push_back({name, p.detach().to(at::kFloat).requires_grad_(true)});
    Optimizer reference(fp32, sbp::parse_optimizer_spec(spec));
    for (int k = 0; k < int(c.grads.size()); ++k) {
      set_grads(c.params, c.grads[k]);
      ours.step(c.lrs[k]);
      std::map<std::string, at::Tensor> grads32;
      for (const auto& [name, g] : c.grads[k]) grads32[name] = g.to(at::kFloat);
      set_grads(fp32, grads32);
      at::NoGradGuard no_grad;
      for (std::size_t i = 0; i < fp32.size(); ++i) fp32[i].tensor.copy_(rounded[i].tensor);
      reference.step(c.lrs[k]);
      for (std::size_t i = 0; i < fp32.size(); ++i) rounded[i].tensor.copy_(fp32[i].tensor);
    }
    require_bitwise_equal(c.params, rounded);
    require_bitwise_equal(ours.state(), reference.state());
  }
}

TEST_CASE("load_state rejects a state of another optimizer, naming the source and the tensor", "[optimizer]") {
  const OptimizerCase c = make_case();
  const OptimizerOptions adamw;
  Optimizer optimizer(c.params, adamw);
  const TensorList good = optimizer.state();
  const std::string w = "model.layers.0.mlp.up_proj.weight";
  const auto edited = [&](const std::string& name, const at::Tensor& replacement) {
    TensorList s;
    for (const auto& [n, t] : good)
      if (n != name) s.push_back({n, t});
      else if (replacement.defined()) s.push_back({n, replacement});
    return s;
  };
  const auto message = [&](const TensorList& state) {
    try {
      optimizer.load_state(state, "run/optimizer.safetensors");
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_NOTHROW(optimizer.load_state(good, "run/optimizer.safetensors"));
  CHECK_THAT(message(edited(w + ".exp_avg", {})),
             Contains("'run/optimizer.safetensors'") && Contains(w + ".exp_avg' is missing"));
  TensorList extra = good;
  extra.push_back({w + ".momentum_buffer", at::zeros({4, 5}, at::kDouble)});
  CHECK_THAT(message(extra), Contains(w + ".momentum_buffer' is not a state"));
  CHECK_THAT(message(edited(w + ".exp_avg_sq", at::zeros({5, 4}, at::kDouble))),
             Contains("shape [5, 4], expected [4, 5]"));
  CHECK_THAT(message(edited(w + ".exp_avg", at::zeros({4, 5}, at::kFloat))), Contains(w + ".exp_avg' has dtype Float"));
  CHECK_THAT(message(edited(w + ".step", at::scalar_tensor(1, at::kLong))),
             Contains(w + ".step' is 1, outside [0, step = 0]"));
  CHECK_THAT(message(edited("step", at::scalar_tensor(-1, at::kLong))), Contains("'step' is negative"));
  TensorList twice = good;
  twice.push_back(good[0]);
  CHECK_THAT(message(twice), Contains("'step' appears twice"));
  OptimizerOptions sgd;
  sgd.kind = sbp::OptimizerKind::Sgd;
  sgd.momentum = 0.9;
  CHECK_THAT(message(Optimizer(c.params, sgd).state()), Contains("is missing"));
  CHECK(optimizer.steps_taken() == 0);  // nothing was loaded from the rejected states
}

TEST_CASE("clip_grad_norm returns the total 2-norm and scales every gradient by max_norm / (norm + 1e-6)",
          "[optimizer]") {
  const auto leaf = [](std::vector<double> grad) {
    auto p = at::zeros({std::int64_t(grad.size())}, at::kDouble).requires_grad_(true);
    p.mutable_grad() = at::tensor(grad, at::kDouble);
    return p;
  };
  const auto a = leaf({3, 4}), b = leaf({12}), none = at::zeros({2}, at::kDouble).requires_grad_(true);
  // |(3, 4, 12)| = 13 exactly; the coefficient as torch computes it, reciprocal first.
  CHECK(sbp::clip_grad_norm({a, none, b}, 100.0) == 13.0);
  CHECK(a.grad()[1].item<double>() == 4.0);  // multiplied by the clamped coefficient 1
  CHECK(sbp::clip_grad_norm({a, none, b}, 6.5) == 13.0);
  const double coef = 1.0 / (13.0 + 1e-6) * 6.5;
  CHECK(a.grad()[0].item<double>() == 3.0 * coef);
  CHECK(a.grad()[1].item<double>() == 4.0 * coef);
  CHECK(b.grad()[0].item<double>() == 12.0 * coef);
  CHECK(std::abs(sbp::clip_grad_norm({a, b}, 6.5) - 6.5) < 1e-6);  // the clipped gradients have norm ~max_norm
  CHECK(sbp::clip_grad_norm({none}, 1.0) == 0.0);
  CHECK(sbp::clip_grad_norm({}, 1.0) == 0.0);
}

TEST_CASE("lr schedules equal HF's constant and cosine schedules at the warmup edges", "[optimizer][schedule]") {
  const double base = 3e-4;
  const sbp::LrSchedule constant = sbp::parse_lr_schedule("constant");
  CHECK(sbp::lr_at(constant, base, 0, 10) == base);
  CHECK(sbp::lr_at(constant, base, 25, 10) == base);

  const sbp::LrSchedule warm = sbp::parse_lr_schedule("constant,warmup=4");
  CHECK(warm.warmup == 4);
  CHECK(sbp::lr_at(warm, base, 0, 10) == 0.0);  // the first step of a warmup does nothing, as in HF
  CHECK(sbp::lr_at(warm, base, 1, 10) == base * (1.0 / 4.0));
  CHECK(sbp::lr_at(warm, base, 3, 10) == base * (3.0 / 4.0));
  CHECK(sbp::lr_at(warm, base, 4, 10) == base);
  CHECK(sbp::lr_at(warm, base, 5, 10) == base);

  const sbp::LrSchedule cosine = sbp::parse_lr_schedule("cosine,warmup=2");
  CHECK(sbp::lr_at(cosine, base, 0, 10) == 0.0);
  CHECK(sbp::lr_at(cosine, base, 1, 10) == base * 0.5);
  CHECK(sbp::lr_at(cosine, base, 2, 10) == base);  // cos(0) = 1: the peak right after warmup
  CHECK(sbp::lr_at(cosine, base, 6, 10) == base * (0.5 * (1.0 + std::cos(std::numbers::pi * 0.5))));
  CHECK(sbp::lr_at(cosine, base, 10, 10) == 0.0);  // cos(pi) rounds to -1 exactly
  // Past the end HF's formula rises again (cos beyond pi); we follow it rather than clamp.
  CHECK(sbp::lr_at(cosine, base, 12, 10) == base * (0.5 * (1.0 + std::cos(std::numbers::pi * 1.25))));
  CHECK(sbp::lr_at(sbp::parse_lr_schedule("cosine"), base, 0, 10) == base);
  // warmup >= total: HF divides by max(1, total - warmup).
  CHECK(sbp::lr_at(sbp::parse_lr_schedule("cosine,warmup=20"), base, 25, 10) ==
        base * (0.5 * (1.0 + std::cos(std::numbers::pi * 5))));

  CHECK(sbp::lr_schedule_spec(cosine) == "cosine,warmup=2");
  CHECK(sbp::lr_schedule_spec(constant) == "constant");
  CHECK_THROWS_WITH(sbp::parse_lr_schedule("linear"), Contains("unknown schedule 'linear'"));
  CHECK_THROWS_WITH(sbp::parse_lr_schedule("cosine,warmup=-1"), Contains("warmup=-1"));
  CHECK_THROWS_WITH(sbp::parse_lr_schedule("cosine,cycles=2"), Contains("unknown option 'cycles'"));
  CHECK_THROWS_WITH(sbp::parse_lr_schedule("cosine,warmup"), Contains("expected key=value"));
  CHECK_THROWS_WITH(sbp::parse_lr_schedule("cosine,"), Contains("trailing ','"));
  CHECK_THROWS_WITH(sbp::lr_at(cosine, base, -1, 10), Contains("must be >= 0"));
}

TEST_CASE("an optimizer step allocates exactly the temporaries of its memory model", "[optimizer][meter]") {
  auto& meter = sbp::CpuMemoryMeter::install();
  struct Config {
    const char* spec;
    at::ScalarType dtype, state_dtype;
  };
  for (const Config& config :
       {Config{"adamw:weight_decay=0.1", at::kFloat, at::ScalarType::Undefined},
        Config{"adamw:weight_decay=0.1", at::kBFloat16, at::ScalarType::Undefined},
        Config{"adamw:weight_decay=0.1", at::kBFloat16, at::kFloat},
        Config{"adamw", at::kBFloat16, at::kFloat},
        Config{"sgd:momentum=0.9,weight_decay=0.1", at::kFloat, at::ScalarType::Undefined},
        Config{"sgd:momentum=0.9,weight_decay=0.1,decay_norms_and_biases=0", at::kBFloat16, at::kFloat},
        Config{"sgd:momentum=0.9", at::kDouble, at::kFloat}, Config{"sgd", at::kDouble, at::ScalarType::Undefined}}) {
    OptimizerOptions o = sbp::parse_optimizer_spec(config.spec);
    o.state_dtype = config.state_dtype;
    INFO(sbp::optimizer_spec(o) << ", " << c10::toString(config.dtype) << " parameters, states in "
                                << c10::toString(config.state_dtype));
    // The largest tensor is a norm weight, so that HF's groups (no decay for it) change SGD's worst update; it is
    // longer than AdamW's update slice (2^16 elements), so that the slice, not the tensor, bounds denom.
    const std::vector<sbp::ParamShape> shapes = {{"model.layers.0.mlp.up_proj.weight", {33, 17}, config.dtype},
                                                 {"model.norm.weight", {70000}, config.dtype},
                                                 {"model.layers.0.mlp.up_proj.bias", {5}, config.dtype}};
    TensorList params;
    for (const auto& s : shapes) {
      const auto p = at::rand(s.shape, at::kDouble).to(config.dtype).requires_grad_(true);
      p.mutable_grad() = at::randn(s.shape, at::kDouble).to(config.dtype);
      params.push_back({s.name, p});
    }
    Optimizer optimizer(params, o);
    const auto model = sbp::optimizer_memory(o, shapes);
    CHECK(optimizer.state_bytes() == model.state_bytes);
    const auto before = meter.current_bytes();
    meter.reset_peak();
    optimizer.step(1e-3);
    optimizer.step(1e-3);  // SGD's momentum update (its worst) starts at the second
    CHECK(meter.peak_bytes() - before == model.step_temporary_bytes);
    CHECK(meter.current_bytes() == before);
  }
}
