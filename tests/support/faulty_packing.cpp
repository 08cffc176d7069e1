#include "tests/support/faulty_packing.h"

#include <algorithm>
#include <stdexcept>

#include <ATen/ATen.h>

namespace sbp::test {

std::vector<PackedRows::Run> LeakyBoundaryRows::runs(std::int64_t row, std::int64_t s, std::int64_t e) const {
  auto runs = PackedRows::runs(row, s, e);
  if (row != row_) return runs;
  std::vector<Run> out;
  for (auto r : runs) {
    if (r.sequence_start == boundary_) {
      r.sequence_start = sequence_start(row, boundary_ - 1);  // the run also sees the sequence before the boundary
      if (!out.empty()) {  // ... which then is one run with the one before it
        out.back().end = r.end;
        continue;
      }
    }
    out.push_back(r);
  }
  return out;
}

at::Tensor UnrestartedPositionRows::positions(std::int64_t s, std::int64_t e) const {
  return at::arange(s, e, at::kLong).expand({rows(), e - s});
}

at::Tensor LocalRestartRows::positions(std::int64_t s, std::int64_t e) const {
  auto out = PackedRows::positions(s, e).clone();
  auto a = out.accessor<std::int64_t, 2>();
  for (std::int64_t b = 0; b < rows(); ++b)
    for (std::int64_t t = s; t < e; ++t) {
      // The latest of the sequence's start and the start of the rank's block holding t counts as 0.
      std::int64_t from = sequence_start(b, t);
      for (const auto start : block_starts_)
        if (start <= t) from = std::max(from, start);
      a[b][t - s] = t - from;
    }
  return out;
}

Objective::Fields SeparatorKeepingSft::prepare_fields(const Batch& batch, const ModelConfig& config,
                                                      const std::optional<StepTotals>& step_totals,
                                                      const std::string& source) const {
  auto fields = SftObjective::prepare_fields(batch, config, step_totals, source);
  const auto& starts = batch.packed->starts(0);
  if (starts.size() < 2) throw std::logic_error("SeparatorKeepingSft: row 0 holds one sequence");
  fields.targets = fields.targets.clone();
  fields.targets[0][starts[1] - 1] = batch.input_ids[0][starts[1]];
  return fields;
}

}  // namespace sbp::test
