// `streambp compare REF OTHER`: per-tensor gradient errors; the exit code is the verdict.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "core/io/safetensors.h"
#include "experiments/commands.h"
#include "experiments/provenance.h"
#include "verify/grad_compare.h"

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
  app.add_option("--json", a.json, "write the per-tensor report (JSON)");
  app.add_flag("--force", a.force, "overwrite an existing --json file");
}

int compare_command(const CompareArgs& a, const std::string& command_line) {
  if (!a.json.empty()) check_new_output(a.json, a.force, "--json");
  const auto cmp = compare_gradients(read_safetensors(a.ref), read_safetensors(a.other));
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
    nlohmann::json j = {{"status", ok ? "passed" : "incorrect"}, {"rtol", a.rtol}, {"reference", a.ref},
                        {"other", a.other}, {"max_normwise_rel", cmp.max_normwise_rel()}, {"problems", cmp.problems},
                        {"global_max_abs", cmp.global_max_abs}, {"degenerate_floor", cmp.floor},
                        {"tensors", tensors}, {"provenance", to_json(collect_provenance(command_line))}};
    write_file_atomically(a.json, j.dump(2) + "\n");
  }
  return ok ? 0 : 1;
}

}  // namespace sbp
