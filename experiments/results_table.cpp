#include "experiments/results_table.h"

#include <algorithm>
#include <charconv>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "core/io/safetensors.h"
#include "core/io/input_error.h"

namespace sbp {
namespace {

const std::vector<std::string> kCommon = {"commit", "date", "machine", "threads", "torch_version",
                                          "preset", "method", "dtype", "seed", "status"};

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

// One line of CSV as csv_field writes it (quoted fields with doubled quotes; no newlines inside fields).
std::vector<std::string> csv_split(const std::string& line) {
  std::vector<std::string> out(1);
  bool quoted = false;
  for (std::size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted && c == '"' && i + 1 < line.size() && line[i + 1] == '"') out.back() += '"', ++i;
    else if (c == '"') quoted = !quoted;
    else if (c == ',' && !quoted) out.emplace_back();
    else out.back() += c;
  }
  return out;
}

}  // namespace

const char* check_status_name(CheckStatus status) {
  switch (status) {
    case CheckStatus::reference: return "reference";
    case CheckStatus::unchecked: return "unchecked";
    case CheckStatus::passed: return "passed";
    case CheckStatus::incorrect: return "incorrect";
  }
  return "?";
}

std::string ResultsTable::value(const Row& row, const std::string& column) const {
  const auto it = std::find(columns_.begin(), columns_.end(), column);
  const auto i = std::size_t(it - columns_.begin());
  return it == columns_.end() || i >= row.values.size() ? "" : row.values[i];
}

std::filesystem::path ResultsTable::new_path(const std::filesystem::path& dir, const std::string& stem,
                                             const Provenance& p) {
  std::string stamp = p.date_utc;
  for (char& c : stamp)
    if (c == ':') c = '-';
  auto csv = dir / (stem + "-" + stamp + "-" + p.commit + ".csv");
  for (int i = 2; std::filesystem::exists(csv); ++i)  // same second, same commit: never overwrite
    csv = dir / (stem + "-" + stamp + "-" + p.commit + "-" + std::to_string(i) + ".csv");
  return csv;
}

std::filesystem::path ResultsTable::write(const std::filesystem::path& dir, const std::string& stem,
                                          const Provenance& p) const {
  std::filesystem::create_directories(dir);
  const auto csv = new_path(dir, stem, p);
  write_to(csv, p);
  return csv;
}

void ResultsTable::write_to(const std::filesystem::path& csv, const Provenance& p, const nlohmann::json& earlier) const {
  if (csv.has_parent_path()) std::filesystem::create_directories(csv.parent_path());
  std::ostringstream out;
  for (std::size_t i = 0; i < kCommon.size(); ++i) out << (i ? "," : "") << kCommon[i];
  for (const auto& c : columns_) out << ',' << csv_field(c);
  out << '\n';
  for (const auto& r : rows_) {
    if (r.provenance.empty())
      out << csv_field(p.commit) << ',' << csv_field(p.date_utc) << ',' << csv_field(p.machine) << ',' << p.threads
          << ',' << csv_field(p.torch_version);
    else
      for (std::size_t i = 0; i < r.provenance.size(); ++i) out << (i ? "," : "") << csv_field(r.provenance[i]);
    // Every text cell through csv_field: a resumed file's cells are whatever it held (fuzz_results_csv found a dtype
    // cell with a quoted comma written back bare, which split the row).
    out << ',' << csv_field(r.preset) << ',' << csv_field(r.method) << ',' << csv_field(r.dtype) << ',' << r.seed << ','
        << csv_field(r.status);
    for (const auto& v : r.values) out << ',' << csv_field(v);
    out << '\n';
  }
  write_file_atomically(csv, out.str());
  auto sidecar = csv;
  sidecar.replace_extension(".json");
  nlohmann::json j{{"csv", csv.filename().string()}, {"provenance", to_json(p)}};
  if (!earlier.empty()) j["resumed_runs"] = earlier;
  write_file_atomically(sidecar, j.dump(2) + "\n");
}

ResultsTable ResultsTable::read(const std::filesystem::path& csv, nlohmann::json* earlier) {
  std::ifstream in(csv);
  if (!in) throw InputError(csv.string() + ": cannot read");
  std::string line;
  std::getline(in, line);
  auto header = csv_split(line);
  if (header.size() < kCommon.size() || !std::equal(kCommon.begin(), kCommon.end(), header.begin()))
    throw InputError(csv.string() + ": not a results CSV (its header does not start with " +
                                "commit,date,...,status)");
  ResultsTable table({header.begin() + std::ptrdiff_t(kCommon.size()), header.end()});
  for (int n = 2; std::getline(in, line); ++n) {
    if (line.empty()) continue;
    auto cells = csv_split(line);
    if (cells.size() != header.size())
      throw InputError(csv.string() + ": line " + std::to_string(n) + " has " + std::to_string(cells.size()) +
                                  " fields, the header " + std::to_string(header.size()));
    Row r;
    r.provenance.assign(cells.begin(), cells.begin() + 5);
    r.preset = cells[5], r.method = cells[6], r.dtype = cells[7], r.status = cells[9];
    const auto [end, error] = std::from_chars(cells[8].data(), cells[8].data() + cells[8].size(), r.seed);
    if (cells[8].empty() || error != std::errc() || end != cells[8].data() + cells[8].size())
      throw InputError(csv.string() + ": line " + std::to_string(n) + ": seed '" + cells[8] +
                                  "' is not an unsigned 64-bit integer");
    r.values.assign(cells.begin() + std::ptrdiff_t(kCommon.size()), cells.end());
    table.add(std::move(r));
  }
  if (earlier) {
    auto sidecar = csv;
    sidecar.replace_extension(".json");
    std::ifstream js(sidecar);
    *earlier = nlohmann::json::array();
    if (js) {
      // A sidecar that is there but broken would silently drop the earlier runs' provenance from the resumed file.
      const auto j = nlohmann::json::parse(js, nullptr, /*allow_exceptions=*/false);
      const auto broken = [&](const std::string& what) {
        throw InputError(csv.string() + ": its sidecar " + sidecar.string() + " " + what);
      };
      if (!j.is_object()) broken("is not a JSON object");
      if (j.contains("resumed_runs")) {
        if (!j["resumed_runs"].is_array()) broken("has a \"resumed_runs\" that is not a list");
        *earlier = j["resumed_runs"];
      }
      if (j.contains("provenance")) earlier->push_back(j["provenance"]);
    }
  }
  return table;
}

std::vector<std::string> read_metrics_rows(const std::filesystem::path& file, const std::string& header,
                                           std::int64_t through) {
  std::ifstream in(file);
  std::string line;
  if (!std::getline(in, line) || line != header)
    throw InputError("--metrics " + file.string() + ": not a metrics file of `train` (header differs)");
  std::vector<std::string> rows;
  for (int n = 2; std::getline(in, line); ++n) {
    if (line.empty()) continue;
    const auto cell = line.substr(0, line.find(','));
    std::int64_t step = 0;
    const auto [end, error] = std::from_chars(cell.data(), cell.data() + cell.size(), step);
    if (cell.empty() || error != std::errc() || end != cell.data() + cell.size())
      throw InputError("--metrics " + file.string() + ": line " + std::to_string(n) + ": step '" + cell +
                                  "' is not an integer");
    if (step <= through) rows.push_back(line);
  }
  return rows;
}

}  // namespace sbp
