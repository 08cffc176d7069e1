// Every gradient verdict fails a NaN or an Inf, whichever input holds it (issue #44): a comparison with NaN is false,
// so `error > tol` never fires and a NaN passed compare when it sat in the reference. Each verdict, each input
// position, NaN and +Inf: the verdict fails, names the tensor and the input it is in, and the finite tensors beside it
// keep their own numbers (an Inf in the reference once made the model-wide floor infinite). The memory models' check
// (test_support's matches_model) fails a 0 on either side.
#include <catch2/catch.hpp>

#include <filesystem>
#include <limits>
#include <string>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "baselines/methods.h"
#include "core/methods/streambp.h"
#include "core/methods/streaming.h"
#include "core/model/model.h"
#include "experiments/commands.h"
#include "tests/support/test_support.h"
#include "verify/conformance.h"
#include "verify/grad_compare.h"

namespace {

using sbp::TensorList;

const double kNaN = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

std::string value_name(double v) { return v == v ? "+Inf" : "NaN"; }

bool mentions(const std::vector<std::string>& problems, const std::string& what) {
  for (const auto& p : problems)
    if (p.find(what) != std::string::npos) return true;
  return false;
}

std::string joined(const std::vector<std::string>& problems) {
  std::string out;
  for (const auto& p : problems) out += p + "\n";
  return out;
}

// Two tensors ~ N(0, 1), "w0" and "bad"; the faults go into one entry of "bad".
TensorList oracle_gradients(at::Generator& gen) {
  return {{"w0", at::normal(0.0, 1.0, {256}, gen, at::kDouble)}, {"bad", at::normal(0.0, 1.0, {256}, gen, at::kDouble)}};
}

// The oracle plus relative noise of scale sigma, as rounding makes it.
TensorList noisy(const TensorList& oracle, double sigma, at::Generator& gen) {
  TensorList out;
  for (const auto& t : oracle) out.push_back({t.name, t.tensor + t.tensor * at::normal(0.0, sigma, t.tensor.sizes(), gen, at::kDouble)});
  return out;
}

TensorList with_value(TensorList list, double value) {
  for (auto& t : list) t.tensor = t.tensor.clone();
  for (auto& t : list)
    if (t.name == "bad") t.tensor.view({-1})[7] = value;
  return list;
}

}  // namespace

TEST_CASE("compare fails a NaN or Inf in the reference, the other file or both, naming the tensor and the file",
          "[nonfinite][compare]") {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(44);
  const auto clean = oracle_gradients(gen);
  for (const double value : {kNaN, kInf})
    for (const std::string position : {"reference", "other", "both"}) {
      DYNAMIC_SECTION(value_name(value) << " in " << position) {
        const auto bad = with_value(clean, value);
        const bool in_ref = position != "other", in_other = position != "reference";
        const auto cmp = sbp::compare_gradients(in_ref ? bad : clean, in_other ? bad : clean, {"REF a.st", "OTHER b.st"});
        INFO(joined(cmp.problems));
        CHECK_FALSE(cmp.passed(1e-10));
        REQUIRE(cmp.worst() != nullptr);
        CHECK(cmp.worst()->name == "bad");
        CHECK(cmp.max_normwise_rel() == kInf);
        CHECK(mentions(cmp.problems, "'bad' has 1 " + std::string(value == value ? "Inf" : "NaN") + " entry in "));
        CHECK(mentions(cmp.problems, "in REF a.st") == in_ref);
        CHECK(mentions(cmp.problems, "in OTHER b.st") == in_other);
        // The finite tensor is judged as if the fault were not there: equal (both) or exact.
        CHECK(cmp.tensors[0].name == "w0");
        CHECK(cmp.tensors[0].normwise_rel == 0.0);
        CHECK(cmp.tensors[0].finite());
        CHECK_FALSE(cmp.tensors[1].finite());
      }
    }
  // The control: the clean pair passes.
  CHECK(sbp::compare_gradients(clean, clean).passed(1e-10));
}

TEST_CASE("the low-precision rule fails a NaN or Inf in the oracle, the baseline or the method, naming tensor and input",
          "[nonfinite][rule]") {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(45);
  const auto oracle = oracle_gradients(gen);
  const auto baseline = noisy(oracle, 1e-3, gen), method = noisy(oracle, 1e-3, gen);
  const sbp::GradInputs standard_inputs{"the oracle", "the baseline"}, method_inputs{"the oracle", "the method"};
  // The control: an exact method (the same noise as the baseline's) passes.
  REQUIRE(sbp::low_precision_rule(sbp::compare_gradients(oracle, baseline, standard_inputs),
                                  sbp::compare_gradients(oracle, method, method_inputs), at::kBFloat16)
              .passed());
  for (const double value : {kNaN, kInf})
    for (const std::string position : {"the oracle", "the baseline", "the method"}) {
      DYNAMIC_SECTION(value_name(value) << " in " << position) {
        const auto& o = position == "the oracle" ? with_value(oracle, value) : oracle;
        const auto& b = position == "the baseline" ? with_value(baseline, value) : baseline;
        const auto& m = position == "the method" ? with_value(method, value) : method;
        const auto verdict = sbp::low_precision_rule(sbp::compare_gradients(o, b, standard_inputs),
                                                     sbp::compare_gradients(o, m, method_inputs), at::kBFloat16);
        INFO(joined(verdict.problems) << "worst " << verdict.worst_ratio << " on " << verdict.worst_tensor);
        CHECK_FALSE(verdict.passed());
        CHECK(verdict.worst_tensor == "bad");
        CHECK(verdict.worst_ratio == kInf);
        CHECK(mentions(verdict.problems, "'bad' has 1"));
        CHECK(mentions(verdict.problems, "in " + position));
        // A fault in the oracle is one problem, said once, though both comparisons see it.
        CHECK(verdict.problems.size() == 1);
        // The finite tensor keeps its own judgement: the common scale is taken over finite tensors.
        REQUIRE(verdict.tensors.size() == 2);
        CHECK(verdict.tensors[0].statistic < 1);
        CHECK(verdict.scale.statistic < 1);
      }
    }
}

TEST_CASE("conform's judges fail a NaN or Inf in the harness's oracle, the baseline or the implementation",
          "[nonfinite][conform]") {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(46);
  const auto oracle = oracle_gradients(gen);
  const auto baseline = noisy(oracle, 1e-3, gen), got = noisy(oracle, 1e-3, gen);
  REQUIRE(sbp::judge_exact(oracle, oracle, 1e-10).passed);
  REQUIRE(sbp::judge_low_precision(oracle, baseline, got, at::kBFloat16).passed);
  for (const double value : {kNaN, kInf}) {
    DYNAMIC_SECTION("fp64, " << value_name(value) << " in the oracle") {
      const auto v = sbp::judge_exact(with_value(oracle, value), oracle, 1e-10);
      INFO(v.problem);
      CHECK_FALSE(v.passed);
      CHECK(v.problem.find("'bad' has 1") != std::string::npos);
      CHECK(v.problem.find("the harness's fp64 oracle") != std::string::npos);
    }
    DYNAMIC_SECTION("fp64, " << value_name(value) << " in the implementation") {
      const auto v = sbp::judge_exact(oracle, with_value(oracle, value), 1e-10);
      INFO(v.problem);
      CHECK_FALSE(v.passed);
      CHECK(v.problem.find("'bad' has 1 non-finite") != std::string::npos);
    }
    for (const std::string position : {"oracle", "baseline", "implementation"}) {
      DYNAMIC_SECTION("low precision, " << value_name(value) << " in the " << position) {
        const auto v = sbp::judge_low_precision(position == "oracle" ? with_value(oracle, value) : oracle,
                                                position == "baseline" ? with_value(baseline, value) : baseline,
                                                position == "implementation" ? with_value(got, value) : got,
                                                at::kBFloat16);
        INFO(v.problem);
        CHECK_FALSE(v.passed);
        CHECK(v.problem.find("'bad' has 1") != std::string::npos);
        CHECK(v.problem.find(position == "oracle" ? "oracle" : position == "baseline" ? "the baseline's" : "'bad'") !=
              std::string::npos);
      }
    }
  }
}

namespace {

// StreamBP whose final-norm gradient gets one NaN or Inf entry after its head: a method's non-finite gradient, put
// there by a test subclass as the negative controls do.
class NonFiniteNormStreamBP : public sbp::StreamBP {
 public:
  NonFiniteNormStreamBP(double value, std::string spec) : StreamBP({8, 8}), value_(value), spec_(std::move(spec)) {}
  std::string spec() const override { return spec_; }

 protected:
  sbp::HeadResult head_and_loss(const sbp::Model& model, const sbp::PreparedObjective& objective,
                                const at::Tensor& h_last, sbp::PhaseClock& clock) const override {
    auto out = StreamBP::head_and_loss(model, objective, h_last, clock);
    model.final_norm_weight().mutable_grad().view({-1})[0] = value_;
    return out;
  }

 private:
  double value_;
  std::string spec_;
};

}  // namespace

TEST_CASE("verify --gate as a command exits 1 on a method with a NaN or Inf gradient", "[nonfinite][gate]") {
  for (const double value : {kNaN, kInf}) {
    const std::string name = value == value ? "nonfinite-norm-inf" : "nonfinite-norm-nan";
    sbp::register_method(name, [value, name](const sbp::Spec& spec) -> std::unique_ptr<sbp::BackpropMethod> {
      spec.check_keys({});
      return std::make_unique<NonFiniteNormStreamBP>(value, name);
    });
  }
  const auto out = std::filesystem::temp_directory_path() / ("streambp-verify-nonfinite-" + std::to_string(::getpid()));
  sbp::VerifyArgs args;
  args.setup.source = args.setup.source.or_preset("tiny");
  args.measure.seq_lens = {16};
  args.gate = true;
  args.output.out_dir = out.string();
  for (const std::string name : {"nonfinite-norm-nan", "nonfinite-norm-inf"}) {
    DYNAMIC_SECTION(name) {
      args.methods = {name};
      CHECK(sbp::verify_command(args, "test") == 1);
    }
  }
  std::filesystem::remove_all(out);
}

TEST_CASE("the memory-model check fails a zero model or a zero measured peak", "[nonfinite][memory]") {
  sbp::MemoryEstimate zero, model;
  model.terms = {{"weights", 1000}};
  CHECK(sbp::test::matches_model(1000, model));  // the control
  CHECK_FALSE(sbp::test::matches_model(0, zero));  // 0 / 0: it matched its own lower bound
  CHECK_FALSE(sbp::test::matches_model(1000, zero));
  CHECK_FALSE(sbp::test::matches_model(0, model));
}

TEST_CASE("conform names returned gradients in another dtype than the case's, which its judges would take as the case's",
          "[conform]") {
  const auto g = [](const char* name, at::ScalarType dtype) { return sbp::NamedTensor{name, at::ones({2, 3}, dtype)}; };
  // Control: the case's dtype throughout is no problem.
  CHECK(sbp::dtype_problem({g("a", at::kBFloat16), g("b", at::kBFloat16)}, at::kBFloat16).empty());
  // fp32 master gradients returned in a bf16 case: more precise than the rule judges bf16 by, so they could pass it.
  const auto one = sbp::dtype_problem({g("a", at::kBFloat16), g("b", at::kFloat)}, at::kBFloat16);
  CHECK(one == "1 of 2 tensor(s) not in the case's dtype bfloat16: 'b' is float32");
  // A whole model in the wrong dtype: three named, the rest counted.
  sbp::TensorList all;
  for (const char* name : {"a", "b", "c", "d", "e"}) all.push_back(g(name, at::kFloat));
  CHECK(sbp::dtype_problem(all, at::kDouble) ==
        "5 of 5 tensor(s) not in the case's dtype float64: 'a' is float32, 'b' is float32, 'c' is float32 and 2 more");
}
