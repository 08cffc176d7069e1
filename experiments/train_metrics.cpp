#include "experiments/train_metrics.h"

#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

namespace sbp {

namespace {

std::string exact(double x) { return fmt::format("{:.17g}", x); }
std::string seconds(double x) { return fmt::format("{:.6f}", x); }
std::string integer(std::int64_t x) { return std::to_string(x); }

// The one table of the file's columns: each name beside its cell.
std::vector<std::pair<std::string_view, std::string>> cells(const StepMetrics& m) {
  const auto& t = m.step;
  return {{"step", integer(t.step)},
          {"loss", exact(t.loss)},
          {"grad_norm", exact(t.grad_norm)},
          {"lr", exact(t.lr)},
          {"tokens", integer(t.tokens)},
          {"bp_seconds", seconds(t.bp_seconds)},
          {"optimizer_seconds", seconds(t.optimizer_seconds)},
          {"peak_bytes", m.peak_bytes ? integer(*m.peak_bytes) : ""},
          {"world_size", integer(m.world_size)},
          {"zero", integer(m.zero)},
          {"all_reduce_calls", integer(m.all_reduce.calls)},
          {"all_reduce_bytes", integer(m.all_reduce.bytes)},
          {"reduce_scatter_calls", integer(m.reduce_scatter.calls)},
          {"reduce_scatter_bytes", integer(m.reduce_scatter.bytes)},
          {"all_gather_calls", integer(m.all_gather.calls)},
          {"all_gather_bytes", integer(m.all_gather.bytes)},
          {"sequence_parallel", integer(m.sp)},
          {"sp_all_gather_calls", integer(m.sp_all_gather.calls)},
          {"sp_all_gather_bytes", integer(m.sp_all_gather.bytes)},
          {"sp_reduce_scatter_calls", integer(m.sp_reduce_scatter.calls)},
          {"sp_reduce_scatter_bytes", integer(m.sp_reduce_scatter.bytes)},
          {"sp_all_reduce_calls", integer(m.sp_all_reduce.calls)},
          {"sp_all_reduce_bytes", integer(m.sp_all_reduce.bytes)},
          {"sp_ring_shift_calls", integer(m.sp_ring_shift.calls)},
          {"sp_ring_shift_bytes", integer(m.sp_ring_shift.bytes)}};
}

// The header (names) or a row (cells), comma-separated.
std::string join(const StepMetrics& m, bool names) {
  std::string line;
  bool first = true;
  for (const auto& [name, cell] : cells(m)) {
    if (!first) line += ',';
    line += names ? std::string(name) : cell;
    first = false;
  }
  return line;
}

}  // namespace

const std::string& metrics_header() {
  static const std::string header = join(StepMetrics{}, true);
  return header;
}

std::string metrics_row(const StepMetrics& m) { return join(m, false); }

}  // namespace sbp
