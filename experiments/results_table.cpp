#include "experiments/results_table.h"

#include <sstream>

#include "core/safetensors.h"

namespace sbp {
namespace {

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

}  // namespace

std::filesystem::path ResultsTable::write(const std::filesystem::path& dir, const std::string& stem,
                                          const Provenance& p) const {
  std::filesystem::create_directories(dir);
  std::string stamp = p.date_utc;
  for (char& c : stamp)
    if (c == ':') c = '-';
  auto csv = dir / (stem + "-" + stamp + "-" + p.commit + ".csv");
  for (int i = 2; std::filesystem::exists(csv); ++i)  // same second, same commit: never overwrite
    csv = dir / (stem + "-" + stamp + "-" + p.commit + "-" + std::to_string(i) + ".csv");
  std::ostringstream out;
  out << "commit,date,machine,threads,torch_version,preset,method,dtype,seed,status";
  for (const auto& c : columns_) out << ',' << csv_field(c);
  out << '\n';
  for (const auto& r : rows_) {
    out << csv_field(p.commit) << ',' << p.date_utc << ',' << csv_field(p.machine) << ',' << p.threads << ','
        << p.torch_version << ',' << csv_field(r.preset) << ',' << csv_field(r.method) << ',' << r.dtype << ','
        << r.seed << ',' << r.status;
    for (const auto& v : r.values) out << ',' << csv_field(v);
    out << '\n';
  }
  write_file_atomically(csv, out.str());
  auto sidecar = csv;
  sidecar.replace_extension(".json");
  write_file_atomically(sidecar, nlohmann::json{{"csv", csv.filename().string()}, {"provenance", to_json(p)}}.dump(2) + "\n");
  return csv;
}

}  // namespace sbp
