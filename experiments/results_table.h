// Results as data with provenance (DESIGN §9): every row carries commit, date, machine, threads, torch version,
// preset, method spec, dtype, seed and status next to its measurements. Files are written atomically and never
// overwrite an earlier result: each run gets a new, time-stamped name.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "experiments/provenance.h"

namespace sbp {

class ResultsTable {
 public:
  // `columns`: the experiment's own columns, after the provenance ones.
  explicit ResultsTable(std::vector<std::string> columns) : columns_(std::move(columns)) {}
  struct Row {
    std::string preset, method, dtype, status;
    std::uint64_t seed = 0;
    std::vector<std::string> values;  // one per column
  };
  void add(Row row) { rows_.push_back(std::move(row)); }
  const std::vector<Row>& rows() const { return rows_; }
  // Writes <dir>/<stem>-<UTC time>-<commit>.csv and a .json sidecar (provenance incl. the command); returns the CSV.
  std::filesystem::path write(const std::filesystem::path& dir, const std::string& stem, const Provenance& p) const;

 private:
  std::vector<std::string> columns_;
  std::vector<Row> rows_;
};

}  // namespace sbp
