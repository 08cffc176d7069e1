// libFuzzer target: a results CSV and its JSON sidecar (the input's two parts) as `sweep --resume FILE` reads them
// (ResultsTable::read). Refusals must name the CSV. A table that reads must be written back (write_to) and read again
// to the same rows: resuming a resumed sweep keeps what the first resume kept.
#include "experiments/provenance.h"
#include "experiments/results_table.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace sbp::fuzz;
  clear_scratch();
  const auto parts = split_parts(data, size);
  const auto csv = put("sweep.csv", parts[0]);
  if (parts.size() > 1) put("sweep.json", parts[1]);
  nlohmann::json earlier;
  sbp::ResultsTable table({});
  if (!refuses_cleanly("ResultsTable::read", csv.string(), [&] { table = sbp::ResultsTable::read(csv, &earlier); }))
    return 0;
  const auto again_csv = scratch() / "again.csv";
  table.write_to(again_csv, sbp::Provenance{}, earlier);
  nlohmann::json earlier_again;
  const auto again = sbp::ResultsTable::read(again_csv, &earlier_again);
  if (again.columns() != table.columns() || again.rows().size() != table.rows().size())
    finding("a resumed table written back has other columns or rows");
  for (std::size_t i = 0; i < table.rows().size(); ++i) {
    const auto &a = table.rows()[i], &b = again.rows()[i];
    if (a.preset != b.preset || a.method != b.method || a.dtype != b.dtype || a.status != b.status ||
        a.seed != b.seed || a.values != b.values || a.provenance != b.provenance)
      finding("row " + std::to_string(i + 1) + " of a resumed table changed when written back");
  }
  return 0;
}
