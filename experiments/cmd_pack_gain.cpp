// `streambp pack-gain`: what packing buys (issue #59, docs/packing.md). The same sequences run twice through one BP
// method: packed, B rows of T holding sequences of --pack's lengths, and padded, one sequence a row, right-padded to the
// longest (padded_sequences: the packed batch's first oracle). Per layout: BP time (median, the layouts interleaved
// repeat by repeat so that a shared machine's drifts hit both), the metered peak beside the model's, the tokens a
// step trains (the sequences' tokens, the same in both) per second, and the FLOP model's step. The gradients of the two
// layouts are checked against each other in fp64 on the same shapes first (1e-10 on every tensor): the row's status.
#include <algorithm>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "baselines/methods.h"
#include "core/io/dtype.h"
#include "core/methods/flop_model.h"
#include "core/objectives/packed_batch.h"
#include "experiments/cli_checks.h"
#include "experiments/commands.h"
#include "experiments/results_table.h"
#include "verify/grad_compare.h"

namespace sbp {

namespace {

constexpr double kPackGainRtol = 1e-10;  // the fp64 exactness gate (ARCHITECTURE.md §8)

// The packed and padded layouts' gradients in fp64 from the same weights: equal to kPackGainRtol on every tensor.
GradComparison check_layouts(const PackGainArgs& a, const Objective& objective, const Batch& packed, const Batch& padded) {
  auto model = build_model(a.setup.source, at::kDouble, a.setup.seed);
  auto method = make_method(a.method);
  method->step(*model, objective, packed);
  const auto packed_gradients = model->gradients();
  method->step(*model, objective, padded);
  return compare_gradients(packed_gradients, model->gradients());
}

std::int64_t sequence_tokens(const Batch& b) { return b.attention_mask.sum().item<std::int64_t>(); }

}  // namespace

void add_pack_gain_options(CLI::App& app, PackGainArgs& a) {
  add_setup_options(app, a.setup, {.lora = false, .adapter = false, .group = false, .device = false,
                                   .default_preset = "qwen3-small"});
  add_method_option(app, a.method);
  add_measure_options(app, a.measure, {.warmup = true, .repeats = true});
  add_pack_option(app, a.pack);
  app.add_flag("--no-check", a.no_check, "skip the fp64 check that both layouts give the same gradients (rows: "
               "unchecked)");
  add_output_options(app, a.output, "results folder");
}

int pack_gain_command(const PackGainArgs& a, const std::string& command_line) {
  if (!a.pack.packed()) throw InputError("--pack DIST is required: the lengths of the sequences packed into each row");
  if (a.measure.seq_len() < 2) throw InputError("--seq T is required: the packed rows' length");
  const auto prov = collect_provenance(command_line);  // the tree as it was when the run started
  Setup setup = a.setup;
  setup.apply_threads();
  const auto objective = build_objective(setup);
  if (const auto why = objective->packed_rows_refusal(); !why.empty()) throw InputError("--objective: " + why);
  auto model = build_model(setup);
  RandomBatchOptions options{a.measure.batch_size(), a.measure.seq_len(), 0.0, 0.0, setup.seed};
  options.pack = a.pack;
  const auto packed = objective->random_batch(model->config(), options);
  const auto padded = padded_sequences(packed);
  auto method = make_method(a.method);
  const auto spec = method->spec();

  const auto check = a.no_check ? GradComparison{} : check_layouts(a, *objective, packed, padded);
  const auto status = a.no_check ? CheckStatus::unchecked
                                 : check.passed(kPackGainRtol) ? CheckStatus::passed : CheckStatus::incorrect;
  if (!a.no_check)
    fmt::print(stderr, "fp64 check, packed against padded: worst tensor {} at {:.3g} ({})\n",
               check.worst() ? check.worst()->name : "-", check.max_normwise_rel(), check_status_name(status));

  struct Layout {
    const char* name;
    const Batch* batch;
    Measurement m;
  };
  std::vector<Layout> layouts = {{"packed", &packed, {}}, {"padded", &padded, {}}};
  for (auto& l : layouts) l.m = measure_method(*model, *method, *objective, *l.batch, a.measure.warmup, 1, 0);
  for (int r = 1; r < a.measure.repeats; ++r)
    for (auto& l : layouts) {
      const auto m = measure_method(*model, *method, *objective, *l.batch, 0, 1, 0);
      l.m.bp_seconds.push_back(m.bp_seconds.at(0));
      l.m.peak_bytes = std::max(l.m.peak_bytes, m.peak_bytes);
    }

  ResultsTable table({"objective", "pack", "layout", "batch_size", "seq_len", "sequences", "longest", "tokens",
                      "positions", "bp_seconds", "bp_seconds_spread", "peak_bytes", "model_peak_bytes",
                      "tokens_per_second", "model_flops", "check_dtype", "check_max_normwise"});
  const auto longest = padded.seq_len();
  fmt::print("{} on {} sequences ({} tokens; --pack {}), {}:\n", spec, packed.packed->sequences(),
             sequence_tokens(packed), a.pack.spec(), dtype_name(model->dtype()));
  for (const auto& l : layouts) {
    if (!l.m.finished()) throw std::runtime_error(std::string(l.name) + " step did not finish: " + l.m.error);
    const auto workload = make_workload(*model, objective->prepare(*l.batch, model->config()), *l.batch);
    const auto model_peak = method->memory_model(workload).total_bytes();
    const auto seconds = l.m.median_seconds();
    const auto [low, high] = std::minmax_element(l.m.bp_seconds.begin(), l.m.bp_seconds.end());
    const auto tokens = sequence_tokens(*l.batch);
    const double rate = double(tokens) / seconds;
    fmt::print("  {:<7} {} x {:<6} bp {:.3f} s (median of {})  peak {} (model {})  {:.0f} tokens/s\n", l.name,
               l.batch->batch_size(), l.batch->seq_len(), seconds, l.m.bp_seconds.size(), format_bytes(l.m.peak_bytes),
               format_bytes(model_peak), rate);
    table.add({setup.source.describe(), spec, dtype_name(model->dtype()), check_status_name(status), setup.seed,
               {objective->spec(), a.pack.spec(), l.name, std::to_string(l.batch->batch_size()),
                std::to_string(l.batch->seq_len()), std::to_string(packed.packed->sequences()), std::to_string(longest),
                std::to_string(tokens), std::to_string(l.batch->batch_size() * l.batch->seq_len()),
                fmt::format("{:.4f}", seconds), fmt::format("{:.4f}", *high - *low), std::to_string(l.m.peak_bytes),
                std::to_string(model_peak), fmt::format("{:.1f}", rate), fmt::format("{:.4g}", method->flops(workload)),
                a.no_check ? "" : "fp64", a.no_check ? "" : fmt::format("{:.3g}", check.max_normwise_rel())}});
  }
  const auto& p = layouts[0].m;
  const auto& q = layouts[1].m;
  fmt::print("  packed / padded: time {:.3f}, peak {:.3f}\n", p.median_seconds() / q.median_seconds(),
             double(p.peak_bytes) / double(q.peak_bytes));
  const auto csv = table.write(a.output.out_dir, "pack-gain", prov);
  fmt::print("results: {}\n", std::filesystem::absolute(csv).string());
  return status == CheckStatus::incorrect ? 1 : 0;
}

}  // namespace sbp
