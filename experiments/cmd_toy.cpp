// `streambp toy`: the paper's Table 6, the two-linear-layer example of appendix A.1 (verify/linear_toy.h), standard
// BP against the streamed form over D row blocks, in Eigen and in its LibTorch twin: peak and intermediate bytes,
// time (median of repeats interleaved over the partition counts, as a ratio to standard in the same implementation)
// and the equality of the gradients.
#include <algorithm>
#include <cmath>
#include <map>

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "experiments/cli_checks.h"
#include "experiments/commands.h"
#include "experiments/results_table.h"
#include "verify/linear_toy.h"
#include "core/io/input_error.h"

namespace sbp {

void add_toy_options(CLI::App& app, ToyArgs& a) {
  app.add_option("--rows", a.rows, "N, rows of X")->check(CLI::PositiveNumber);
  app.add_option("--dim", a.dim, "m = n = k, the widths of X, Y and Z")->check(CLI::PositiveNumber);
  app.add_option("--partitions", a.partitions, "the row-block counts D, comma-separated (1 = standard BP)")
      ->delimiter(',')->check(sbp::within(std::int64_t(1), std::int64_t(1) << 40))->default_str(join_values(a.partitions));
  app.add_option("--data", a.data, "integer: entries in {-1, 0, 1}, exact in fp32 when N * dim <= 2^24, so the gate is "
                 "bitwise equality; normal: N(0, 1), differences reported, not gated")->check(CLI::IsMember({"integer", "normal"}));
  app.add_option("--repeats", a.repeats, "measured runs per D and implementation (median)")->check(CLI::PositiveNumber);
  app.add_option("--threads", a.threads, "LibTorch intra-op threads (Eigen runs on one)")->check(CLI::NonNegativeNumber);
  app.add_option("--seed", a.seed, "seed of the inputs");
  add_output_options(app, a.output, "results folder");
  app.footer("The paper's example has L = sum(Z); here L = sum(Z * G) with a fixed G, so that the GEMMs with dL/dZ are "
             "real products and not rank-one ones. Peak = X, W1, W2, G, both gradients and the Y/dY of one block: "
             "counted for Eigen (every matrix it holds), measured by the CPU meter for LibTorch.");
}

int toy_command(const ToyArgs& a, const std::string& command_line) {
  if (a.threads > 0) at::set_num_threads(a.threads);
  auto partitions = a.partitions;
  if (partitions.empty() || partitions.front() != 1) partitions.insert(partitions.begin(), 1);  // the reference
  const bool integer = a.data == "integer";
  if (integer && a.rows * a.dim > (std::int64_t(1) << 24))
    throw InputError(fmt::format("--data integer is exact only for N * dim <= 2^24 (got {} x {}); use fewer "
                                            "--rows or --data normal", a.rows, a.dim));
  for (const auto D : partitions) linear_toy_block_rows(a.rows, D);  // every D valid before anything runs
  const auto in = LinearToyInputs::make(a.rows, a.dim, a.dim, a.dim, integer, a.seed);
  fmt::print(stderr, "linear toy: X [{}, {}], W1, W2 [{}, {}], {} data; {} partition counts x 2 implementations x {} "
             "repeats\n", a.rows, a.dim, a.dim, a.dim, a.data, partitions.size(), a.repeats);

  struct Cell {
    LinearToyResult last;
    std::vector<double> seconds;
  };
  std::map<std::pair<std::string, std::int64_t>, Cell> cells;
  for (int r = 0; r < a.repeats; ++r)
    for (const auto D : partitions)
      for (const std::string impl : {"eigen", "libtorch"}) {
        auto result = impl == "eigen" ? linear_toy_eigen(in, D) : linear_toy_torch(in, D);
        fmt::print(stderr, "  [repeat {}/{}] {:<8} D={:<6} {:8.3f} s  peak {}\n", r + 1, a.repeats, impl, D,
                   result.seconds, format_bytes(result.peak_bytes));
        auto& cell = cells[{impl, D}];
        cell.seconds.push_back(result.seconds);
        cell.last = std::move(result);
      }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  };
  auto max_abs_diff = [](const LinearToyResult& x, const LinearToyResult& y) {
    double d = 0;
    for (std::size_t i = 0; i < x.dW1.size(); ++i) d = std::max(d, double(std::abs(x.dW1[i] - y.dW1[i])));
    for (std::size_t i = 0; i < x.dW2.size(); ++i) d = std::max(d, double(std::abs(x.dW2[i] - y.dW2[i])));
    return d;
  };

  ResultsTable table({"impl", "data", "rows", "dim", "partitions", "block_rows", "peak_bytes", "model_peak_bytes",
                      "intermediate_bytes", "bp_seconds", "bp_seconds_all", "time_vs_standard", "bitwise_equal",
                      "max_abs_diff", "eigen_libtorch_bitwise_equal"});
  const std::string preset = fmt::format("linear-toy:rows={},dim={}", a.rows, a.dim);
  bool all_equal = true;
  fmt::print("\n{:<9} {:>6} {:>10} {:>12} {:>14} {:>8} {:>8}  {}\n", "impl", "D", "peak", "intermediate", "vs model", "s",
             "vs std", "gradient");
  for (const std::string impl : {"eigen", "libtorch"}) {
    const auto& standard = cells.at({impl, 1});
    for (const auto D : partitions) {
      const auto& cell = cells.at({impl, D});
      const auto& twin = cells.at({impl == "eigen" ? "libtorch" : "eigen", D}).last;
      const bool equal = cell.last.dW1 == standard.last.dW1 && cell.last.dW2 == standard.last.dW2;
      const bool twins_equal = cell.last.dW1 == twin.dW1 && cell.last.dW2 == twin.dW2;
      // Exact data: bitwise equality with standard BP and with the other implementation is the check.
      const auto status = D == 1 ? CheckStatus::reference : !integer ? CheckStatus::unchecked
                         : equal && twins_equal ? CheckStatus::passed : CheckStatus::incorrect;
      all_equal = all_equal && status != CheckStatus::incorrect;
      const auto model = linear_toy_model_bytes(in, D);
      std::string all;
      for (double s : cell.seconds) all += (all.empty() ? "" : " ") + fmt::format("{:.4f}", s);
      const double ratio = median(cell.seconds) / median(standard.seconds);
      table.add({preset, D == 1 ? "standard" : fmt::format("streamed:partitions={}", D), "fp32", check_status_name(status), a.seed,
                 {impl, a.data, std::to_string(a.rows), std::to_string(a.dim), std::to_string(D),
                  std::to_string(linear_toy_block_rows(a.rows, D)), std::to_string(cell.last.peak_bytes),
                  std::to_string(model), std::to_string(cell.last.intermediate_bytes),
                  fmt::format("{:.4f}", median(cell.seconds)), all, fmt::format("{:.4f}", ratio), equal ? "1" : "0",
                  fmt::format("{:.6g}", max_abs_diff(cell.last, standard.last)), twins_equal ? "1" : "0"}});
      fmt::print("{:<9} {:>6} {:>10} {:>12} {:>14.4f} {:>8.3f} {:>8.3f}  {}\n", impl, D, format_bytes(cell.last.peak_bytes),
                 format_bytes(cell.last.intermediate_bytes), double(cell.last.peak_bytes) / double(model),
                 median(cell.seconds), ratio, check_status_name(status));
    }
  }
  const auto csv = table.write(a.output.out_dir, "toy", collect_provenance(command_line));
  fmt::print("\nresults: {}\n", std::filesystem::absolute(csv).string());
  return all_equal ? 0 : 1;
}

}  // namespace sbp
