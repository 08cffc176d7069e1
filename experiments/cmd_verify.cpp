// `streambp verify`: the paper's Table 7 for any model and batch. Standard BP in fp32 and bf16 (base32, base16) and
// each streamed method in both (stream32, stream16, ...) on the same bf16-representable weights, each measured against
// base32 (the paper's reference) and against the fp64 oracle (standard BP in fp64 on those weights), per module group.
#include <cmath>
#include <limits>
#include <map>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <c10/util/BFloat16.h>
#include <fmt/format.h>

#include "experiments/cli_checks.h"
#include "baselines/methods.h"
#include "core/io/dtype.h"
#include "experiments/commands.h"
#include "experiments/results_table.h"
#include "verify/grad_compare.h"

namespace sbp {
namespace {

struct VerifyRun {
  std::string label, spec;  // "stream16", "streambp:layer_chunk=..."
  c10::ScalarType dtype;
  bool mixed;  // bf16 compute, fp32 masters and gradients (--mixed)
  TensorList gradients;
};

// The paper's short names: base (standard), stream (StreamBP), ckpt, mst; then 32 or 16; then the spec's options
// in brackets when two runs of one method would otherwise share a name (a sweep over chunk counts).
std::string run_label(const std::string& spec, c10::ScalarType dtype, bool mixed, bool with_options) {
  const auto colon = spec.find(':');
  const auto name = spec.substr(0, colon);
  const std::string stem = name == "standard" ? "base" : name == "streambp" ? "stream" : name == "checkpoint" ? "ckpt" : name;
  const std::string options = with_options && colon != std::string::npos ? "[" + spec.substr(colon + 1) + "]" : "";
  return stem + (dtype == at::kBFloat16 ? "16" : dtype == at::kFloat ? "32" : "64") + (mixed ? "m" : "") + options;
}

struct GroupError {
  double er_abs = 0, er_rel = 0, max_normwise = 0, max_l2 = 0;
  std::int64_t tensors = 0, elements = 0;
};

// Table 7's metrics over a module group: Er_abs = mean |g_ref - g| and Er_rel = mean |g_ref - g| / (|g_ref| + 1e-10)
// over every element of the group's tensors; and the largest per-tensor normwise error (degenerate floor applied).
std::map<std::string, GroupError> group_errors(const GradComparison& cmp) {
  std::map<std::string, GroupError> out;
  for (const auto& t : cmp.tensors)
    for (const auto& group : {t.group, std::string(t.name.find(".layers.") != std::string::npos ? "transformer layers" : ""),
                              std::string("all")}) {
      if (group.empty()) continue;
      auto& g = out[group];
      g.er_abs += t.er_abs * double(t.numel);
      g.er_rel += t.er_rel * double(t.numel);
      g.max_normwise = std::max(g.max_normwise, t.normwise_rel);
      g.max_l2 = std::max(g.max_l2, t.l2_rel);
      g.tensors += 1;
      g.elements += t.numel;
    }
  for (auto& [name, g] : out)
    if (g.elements > 0) g.er_abs /= double(g.elements), g.er_rel /= double(g.elements);
  return out;
}

}  // namespace

void add_verify_options(CLI::App& app, VerifyArgs& a) {
  add_setup_options(app, a.setup, {.dtype = false, .grad_dtype = false, .lora = false, .adapter = false, .group = false, .default_preset = "tiny"});
  app.add_option("--batch-file", a.batch_file, "batch (safetensors) instead of a random one")->check(CLI::ExistingFile);
  add_pack_option(app, a.pack);
  add_measure_options(app, a.measure, {});
  add_methods_option(app, a.methods, "the methods verified besides standard BP (e.g. streambp;checkpoint;mst)");
  add_output_options(app, a.output, "results folder (CSV + JSON)");
  app.add_flag("--mixed", a.mixed, "also run every method in bf16 mixed precision (base16m, stream16m, ...: bf16 compute, "
               "fp32 master weights and gradients, run --grad-dtype fp32), gated against base16m");
  app.add_flag("--gate", a.gate, "exit 1 when a method's l2 error against the fp64 oracle (||g - g_oracle|| / ||g_oracle||) "
               "exceeds allowance(n) x standard BP's in the same dtype plus a rounding floor (the error of storing each entry "
               "at 1e-4 of the model's largest gradient entry), on any tensor (naming it); allowance(n) is 2.5x (fp32: 3x) "
               "times the spread of a ratio of two rounding noises over the tensor's n effective entries (bf16: 9.7x at "
               "n = 16, 2.6x at n = 10^4; docs/precision.md), the same rule as the tests and conform");
  app.footer(
      "Every run uses the same weights: the model's, rounded to bf16 once, so that base32/stream32 and the fp64 oracle "
      "see exactly the weights the bf16 runs see and only the arithmetic of the step is measured. Er_abs = mean "
      "|g_ref - g| and Er_rel = mean |g_ref - g| / (|g_ref| + 1e-10) over a group's elements (the paper's Table 7); "
      "normwise = max over the group's tensors of max|g_ref - g| / max|g_ref|, where a tensor whose reference is zero "
      "or at rounding level (max|g_ref| below 1e-4 of the largest |g_ref| of the model) is judged against that floor "
      "instead and reported as degenerate (compare --help). The gate compares whole-tensor l2 errors, "
      "||g - g_oracle||_2 / ||g_oracle||_2 (same floor): the ratio of two methods' largest single-entry errors on a "
      "small tensor is itself rounding noise. The CSV's gate_ratio is error / (allowance x standard + floor): <= 1 passes.");
}

namespace {

// The two printed Markdown tables, a row per run: each module group's Er_abs / Er_rel against base32 (the paper's
// Table 7) and its largest per-tensor l2 error against the fp64 oracle (the gate's metric).
class GroupTables {
 public:
  explicit GroupTables(std::vector<std::string> groups) : groups_(std::move(groups)) {
    base32_ = oracle_ = "| run | ";
    for (const auto& g : groups_) base32_ += g + " Er_abs / Er_rel | ", oracle_ += g + " l2 | ";
    std::string rule = "\n|---|";
    for (std::size_t i = 0; i < groups_.size(); ++i) rule += "---|";
    base32_ += rule + "\n";
    oracle_ += rule + "\n";
  }
  void add(const std::string& label, const std::map<std::string, GroupError>& by_base,
           const std::map<std::string, GroupError>& by_oracle) {
    base32_ += "| " + label + " | ";
    oracle_ += "| " + label + " | ";
    for (const auto& g : groups_) {
      base32_ += by_base.count(g) ? fmt::format("{:.2e} / {:.3g}% | ", by_base.at(g).er_abs, 100 * by_base.at(g).er_rel) : "- | ";
      oracle_ += by_oracle.count(g) ? fmt::format("{:.2e} | ", by_oracle.at(g).max_l2) : "- | ";
    }
    base32_ += "\n";
    oracle_ += "\n";
  }
  void print() const {
    fmt::print("Against base32 (the paper's Table 7 reference): Er_abs / Er_rel per module group\n\n{}\n", base32_);
    fmt::print("Against the fp64 oracle: largest per-tensor l2 error (the gate's metric) per module group\n\n{}\n", oracle_);
  }

 private:
  std::vector<std::string> groups_;
  std::string base32_, oracle_;
};

}  // namespace

int verify_command(const VerifyArgs& args, const std::string& command_line) {
  args.setup.apply_threads();
  VerifyArgs a = args;
  // The fp32/bf16 runs go to --device; the fp64 oracle stays on the CPU (the CUDA attention kernels have no fp64).
  const auto device = a.setup.device;
  // The bf16 weights every run shares, widened exactly to fp32 and fp64.
  const auto bf16 = build_model(a.setup.source, at::kBFloat16, a.setup.seed);
  const auto& config = bf16->config();
  auto objective = build_objective(a.setup);
  Model oracle_model(config, at::kDouble, bf16->parameters(), "bf16 weights");
  const auto source = a.batch_file.empty() ? std::string("random batch") : a.batch_file;
  if (!a.batch_file.empty() && a.pack.packed())
    throw InputError("--pack makes a random batch; a --batch-file brings its own boundaries (position_ids or cu_seqlens)");
  Batch batch = a.batch_file.empty()
                    ? objective->random_batch(config, {a.measure.batch_size(), a.measure.seq_len(), 0.0,
                                                       objective->default_prompt_fraction(), a.setup.seed, 0, a.pack})
                    : read_batch_file(a.batch_file);
  validate_tokens(batch, config, source);
  complete_batch(oracle_model, *objective, batch, source, a.batch_file.empty(), "", at::kDouble, a.setup.seed);
  objective->prepare(batch, config, std::nullopt, source);  // its checks

  const Batch device_batch = batch.to(device);
  auto step = [&](Model& model, const std::string& spec) {
    auto method = make_method(spec);
    method->step(model, *objective, model.device() == device ? device_batch : batch);
    TensorList grads;
    for (const auto& g : model.gradients()) grads.push_back({g.name, g.tensor.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true)});
    model.zero_grad();
    return grads;
  };
  fmt::print(stderr, "verify: {} ({}), {}, B={} T={}; fp64 oracle...\n", a.setup.source.describe(), config.name,
             objective->spec(), batch.batch_size(), batch.seq_len());
  const auto oracle = step(oracle_model, "standard");
  Model fp32(config, at::kFloat, bf16->parameters(), "bf16 weights");
  fp32.to(device);
  std::vector<std::string> specs = {"standard"};
  for (const auto& m : a.methods) specs.push_back(make_method(m)->spec());
  std::map<std::string, int> method_count;  // runs of each method per dtype: > 1 puts the options into the labels
  for (const auto& spec : specs) ++method_count[spec.substr(0, spec.find(':'))];
  std::unique_ptr<Model> mixed;  // the same bf16 weights as fp32 masters
  if (a.mixed) {
    mixed = std::make_unique<Model>(config, at::kBFloat16, bf16->parameters(), "bf16 weights");
    mixed->set_grad_dtype(at::kFloat);
    mixed->to(device);
  }
  bf16->to(device);  // last: the oracle, fp32 and mixed models were made from its CPU weights
  std::vector<VerifyRun> runs;
  for (const auto& [dtype, is_mixed] : {std::pair{at::kFloat, false}, {at::kBFloat16, false}, {at::kBFloat16, true}}) {
    if (is_mixed && !mixed) continue;
    Model& model = is_mixed ? *mixed : dtype == at::kFloat ? fp32 : *bf16;
    for (const auto& spec : specs) {
      runs.push_back({run_label(spec, dtype, is_mixed, method_count[spec.substr(0, spec.find(':'))] > 1), spec, dtype,
                      is_mixed, step(model, spec)});
      fmt::print(stderr, "  {} done\n", runs.back().label);
    }
  }
  const auto& base32 = runs.front().gradients;

  const std::vector<std::string> groups = {"embedding/head", "attention", "mlp", "norms", "transformer layers", "all"};
  ResultsTable table({"objective", "batch_size", "seq_len", "run", "reference", "group", "tensors", "er_abs", "er_rel",
                      "max_normwise_rel", "max_l2_rel", "gate_ratio", "worst_tensor"});
  bool gate_ok = true;
  int gated = 0;
  double worst_gate_ratio = 0;
  std::string worst_gate_run;
  GroupTables tables(groups);
  for (const auto& run : runs) {
    const auto against_base = compare_gradients(base32, run.gradients);
    const auto against_oracle = compare_gradients(oracle, run.gradients, {"the fp64 oracle", run.label});
    // The gate: every tensor's error against the oracle within the low-precision rule's allowance x standard BP's in
    // the same dtype + the rounding floor (low_precision_rule, the tests' and conform's rule).
    const VerifyRun* standard = nullptr;
    for (const auto& r : runs)
      if (r.dtype == run.dtype && r.mixed == run.mixed && r.spec == "standard") standard = &r;
    RuleVerdict verdict;
    const bool is_reference = run.spec == "standard";
    if (!is_reference)
      verdict = low_precision_rule(compare_gradients(oracle, standard->gradients, {"the fp64 oracle", standard->label}),
                                   against_oracle, run.dtype);
    const double gate_ratio = verdict.worst_ratio;
    const auto& worst_tensor = verdict.worst_tensor;
    const auto status = is_reference ? CheckStatus::reference : !a.gate ? CheckStatus::unchecked
                       : verdict.passed() ? CheckStatus::passed : CheckStatus::incorrect;
    if (a.gate && !is_reference) {
      ++gated;
      if (gate_ratio >= worst_gate_ratio) worst_gate_ratio = gate_ratio, worst_gate_run = run.label + " on " + worst_tensor;
    }
    if (a.gate && !is_reference && !verdict.passed()) {
      gate_ok = false;
      for (const auto& p : verdict.problems) fmt::print(stderr, "gate: {} fails: {}\n", run.label, p);
      fmt::print(stderr, "gate: {} fails on {}: l2 error {:.3g} against standard's {:.3g}, {:.3g}x the allowed {:.2f}x "
                 "standard + rounding floor ({:.0f} effective entries)\n", run.label, worst_tensor, verdict.method_error,
                 verdict.standard_error, gate_ratio, verdict.allowance, verdict.effective_entries);
    }
    const auto by_base = group_errors(against_base), by_oracle = group_errors(against_oracle);
    tables.add(run.label, by_base, by_oracle);
    for (const auto& [reference, errors] : {std::pair{std::string("base32"), by_base}, std::pair{std::string("fp64"), by_oracle}})
      for (const auto& [group, e] : errors)
        table.add({a.setup.source.describe(), run.spec, precision_name(run.dtype, run.mixed ? at::kFloat : run.dtype),
                   check_status_name(status), a.setup.seed,
                   {objective->spec(), std::to_string(batch.batch_size()), std::to_string(batch.seq_len()), run.label,
                    reference, group, std::to_string(e.tensors), fmt::format("{:.6e}", e.er_abs),
                    fmt::format("{:.6e}", e.er_rel), fmt::format("{:.6e}", e.max_normwise), fmt::format("{:.6e}", e.max_l2),
                    is_reference ? "" : fmt::format("{:.4f}", gate_ratio), worst_tensor}});
  }
  tables.print();
  const auto csv = table.write(a.output.out_dir, "verify", collect_provenance(command_line, describe_device(device)));
  fmt::print("results: {}\n", std::filesystem::absolute(csv).string());
  // The verdict last, where a reader (or CI's log) looks: every gated run, its worst ratio to the allowance.
  if (a.gate)
    fmt::print("gate: {}: {} run{} against standard BP in the same dtype; worst {:.3f} of the allowance ({})\n",
               gate_ok ? "PASS" : "FAIL", gated, gated == 1 ? "" : "s", worst_gate_ratio, worst_gate_run);
  return gate_ok ? 0 : 1;
}

}  // namespace sbp
