// Results as data with provenance (ARCHITECTURE.md §9): every row carries commit, date, machine, threads, torch version,
// preset, method spec, dtype, seed and status next to its measurements. Files are written atomically and never
// overwrite an earlier result: each run gets a new, time-stamped name; a resumed sweep rewrites its own file with
// the earlier rows kept verbatim (their provenance included).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "experiments/provenance.h"

namespace sbp {

// A row's gradient check, the status column of the commands that check one (sweep, verify, toy, compare): the
// reference itself, not checked, or checked and passed or not.
enum class CheckStatus { reference, unchecked, passed, incorrect };
const char* check_status_name(CheckStatus status);  // "reference", "unchecked", "passed", "incorrect"

class ResultsTable {
 public:
  // `columns`: the experiment's own columns, after the provenance ones.
  explicit ResultsTable(std::vector<std::string> columns) : columns_(std::move(columns)) {}
  struct Row {
    std::string preset, method, dtype, status;
    std::uint64_t seed = 0;
    std::vector<std::string> values;  // one per column
    // The provenance cells (commit .. torch_version) of a row read back from a file; empty: this run's.
    std::vector<std::string> provenance;
  };
  void add(Row row) { rows_.push_back(std::move(row)); }
  const std::vector<Row>& rows() const { return rows_; }
  const std::vector<std::string>& columns() const { return columns_; }
  // A row's value of one of the experiment's columns ("" when absent).
  std::string value(const Row& row, const std::string& column) const;
  // Writes <dir>/<stem>-<UTC time>-<commit>.csv and a .json sidecar (provenance incl. the command); returns the CSV.
  std::filesystem::path write(const std::filesystem::path& dir, const std::string& stem, const Provenance& p) const;
  // The name write() would choose (a new file, never an existing one).
  static std::filesystem::path new_path(const std::filesystem::path& dir, const std::string& stem, const Provenance& p);
  // Writes exactly `csv` (atomically) and its sidecar; `earlier`: provenance of the runs this file resumes.
  void write_to(const std::filesystem::path& csv, const Provenance& p,
                const nlohmann::json& earlier = nlohmann::json::array()) const;
  // Reads a file write() made (throws naming the file when it is not one); the sidecar's runs come back in `earlier`.
  static ResultsTable read(const std::filesystem::path& csv, nlohmann::json* earlier = nullptr);

 private:
  std::vector<std::string> columns_;
  std::vector<Row> rows_;
};

// The data rows of an earlier metrics file of `train` (first line `header`, then rows led by their step) with step <=
// `through`, verbatim: a resumed run continues the file. Throws naming the file (and line) when it is not one.
std::vector<std::string> read_metrics_rows(const std::filesystem::path& file, const std::string& header,
                                           std::int64_t through);

}  // namespace sbp
