// `streambp compare REF OTHER`: per-tensor gradient errors; the exit code is the verdict.
#include <algorithm>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "core/io/dtype.h"
#include "core/io/safetensors.h"
#include "experiments/commands.h"
#include "experiments/provenance.h"
#include "experiments/results_table.h"
#include "verify/grad_compare.h"
#include "core/io/input_error.h"

namespace sbp {

void add_compare_options(CLI::App& app, CompareArgs& a) {
  app.add_option("REF", a.ref, "reference gradients (safetensors)")->required()->check(CLI::ExistingFile);
  app.add_option("OTHER", a.other, "gradients to check (safetensors)")->required()->check(CLI::ExistingFile);
  app.add_option("--rtol", a.rtol, "largest accepted normwise relative error max|a-b|/max|a| per tensor")
      ->check(CLI::NonNegativeNumber);
  app.footer(
      "Degenerate tensors: a tensor whose reference gradient is zero or at rounding level (max|a| below 1e-4 of the "
      "largest |a| of the whole reference, e.g. q/k gradients with B=1, T=2) would compare noise with noise. It is "
      "judged against that floor instead, max|a-b| / (1e-4 * global max|a|), and marked 'degenerate' with its absolute "
      "numbers: an exact method passes it, an error of 1e-3 of the global maximum fails it.");
  app.add_option("--baseline", a.baseline,
                 "judge OTHER by the low-precision rule instead of --rtol: REF is the fp64 oracle, BASELINE the "
                 "reference method's gradients in the same dtype as OTHER (e.g. standard BP in bf16); every tensor's "
                 "l2 error must be within allowance(n) x BASELINE's + a rounding floor (the rule of verify --gate, "
                 "conform and the tests: docs/precision.md)")
      ->check(CLI::ExistingFile);
  app.add_option("--dtype", a.dtype, "with --baseline: the precision OTHER was computed in (fp32, bf16, fp16), whose "
                 "unit roundoff sets the rule's floor")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--json", a.json, "write the per-tensor report (JSON)");
  app.add_flag("--force", a.force, "overwrite an existing --json file");
}

namespace {

// compare --baseline: the low-precision rule on every tensor, the statistic per tensor and the verdict.
int low_precision_command(const CompareArgs& a) {
  const auto oracle = read_safetensors(a.ref);
  const auto baseline = compare_gradients(oracle, read_safetensors(a.baseline), {"REF " + a.ref, "--baseline " + a.baseline});
  const auto other = compare_gradients(oracle, read_safetensors(a.other), {"REF " + a.ref, "OTHER " + a.other});
  std::vector<std::string> problems;  // each names its file; REF's appear in both comparisons, printed once
  for (const auto* c : {&baseline, &other})
    for (const auto& p : c->problems)
      if (std::find(problems.begin(), problems.end(), p) == problems.end()) problems.push_back(p);
  for (const auto& p : problems) fmt::print("problem: {}\n", p);
  if (!problems.empty()) {
    fmt::print("FAILED: the rule judges finite gradients of the same tensors in the three files ({} problem{} above)\n",
               problems.size(), problems.size() == 1 ? "" : "s");
    return 1;
  }
  const auto dtype = parse_dtype(a.dtype);
  const auto verdict = low_precision_rule(baseline, other, dtype);
  // Each tensor's error beside the run's common scale, then that scale (verify/grad_compare.h: the rule's two parts).
  fmt::print("{:<52} {:>9} {:>11} {:>11} {:>9} {:>9}\n", "tensor", "entries", "other_l2", "baseline_l2", "allowance",
             "statistic");
  auto row = [](const RuleJudgement& j) {
    fmt::print("{:<52} {:>9.0f} {:>11.3e} {:>11.3e} {:>9.3f} {:>9.3f}{}\n", j.name, j.effective_entries, j.method_error,
               j.standard_error, j.allowance, j.statistic, j.statistic > 1 ? "  > 1" : "");
  };
  for (const auto& j : verdict.tensors) row(j);
  row(verdict.scale);
  fmt::print("{} tensors judged by the low-precision rule ({}): worst {:.3f} of the allowance in {} (l2 error {:.3e}, "
             "baseline {:.3e}, allowance {:.2f}x): {}\n", other.tensors.size(), a.dtype, verdict.worst_ratio,
             verdict.worst_tensor, verdict.method_error, verdict.standard_error, verdict.allowance,
             verdict.passed() ? "PASSED" : "FAILED");
  return verdict.passed() ? 0 : 1;
}

}  // namespace

int compare_command(const CompareArgs& a, const std::string& command_line) {
  if (a.baseline.empty() != a.dtype.empty())
    throw InputError("compare: --baseline and --dtype go together (the low-precision rule needs both)");
  if (!a.baseline.empty()) {
    if (!a.json.empty()) throw InputError("compare: --json is not written with --baseline");
    return low_precision_command(a);
  }
  if (!a.json.empty()) check_new_output(a.json, a.force, "--json");
  const auto cmp = compare_gradients(read_safetensors(a.ref), read_safetensors(a.other), {"REF " + a.ref, "OTHER " + a.other});
  fmt::print("{:<52} {:>10} {:>10} {:>10} {:>12}\n", "tensor", "max_abs", "Er_abs", "Er_rel", "normwise_rel");
  for (const auto& t : cmp.tensors)
    fmt::print("{:<52} {:>10.3e} {:>10.3e} {:>10.3e} {:>12.3e}{}{}\n", t.name, t.max_abs, t.er_abs, t.er_rel,
               t.normwise_rel, t.normwise_rel > a.rtol ? "  > rtol" : "",
               t.degenerate ? fmt::format("  degenerate: max|ref| {:.3e} < floor {:.3e}", t.ref_max_abs, cmp.floor) : "");
  for (const auto& p : cmp.problems) fmt::print("problem: {}\n", p);
  const bool ok = cmp.passed(a.rtol);
  const auto* worst = cmp.worst();
  fmt::print("{} tensors compared, largest normwise relative error {:.3e}{} (rtol {:.1e}): {}\n", cmp.tensors.size(),
             cmp.max_normwise_rel(), worst ? " in " + worst->name : "", a.rtol, ok ? "PASSED" : "FAILED");
  if (!a.json.empty()) {
    nlohmann::json tensors = nlohmann::json::array();
    for (const auto& t : cmp.tensors)
      tensors.push_back({{"name", t.name}, {"group", t.group}, {"numel", t.numel}, {"max_abs", t.max_abs},
                         {"er_abs", t.er_abs}, {"er_rel", t.er_rel}, {"normwise_rel", t.normwise_rel}, {"nmse", t.nmse},
                         {"ref_max_abs", t.ref_max_abs}, {"degenerate", t.degenerate}});
    nlohmann::json j = {{"status", check_status_name(ok ? CheckStatus::passed : CheckStatus::incorrect)}, {"rtol", a.rtol}, {"reference", a.ref},
                        {"other", a.other}, {"max_normwise_rel", cmp.max_normwise_rel()}, {"problems", cmp.problems},
                        {"global_max_abs", cmp.global_max_abs}, {"degenerate_floor", cmp.floor},
                        {"tensors", tensors}, {"provenance", to_json(collect_provenance(command_line))}};
    write_file_atomically(a.json, j.dump(2) + "\n");
  }
  return ok ? 0 : 1;
}

}  // namespace sbp
