// JUnit XML for `streambp conform --junit FILE` (issue #47): the report CI systems (GitHub Actions, GitLab, Jenkins,
// Buildkite) read natively. One <testcase> per judged row; a failure carries its verdict, an N/A case is <skipped>.
#pragma once

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace sbp {

struct JUnitCase {
  enum class Status { passed, failed, skipped };
  std::string classname;  // the CI page's group: "streambp.conform.<objective>"
  std::string name;       // the case's id: its name and dtype (conform_case_id)
  Status status = Status::passed;
  std::string message;    // failed: the worst tensor, its error, the bar and the hint; skipped: the reason
  std::string details;    // the failure's body: the whole verdict line
  double seconds = 0;
  // This case's own provenance (the implementation's python and torch), beside the suite's (the harness's).
  std::vector<std::pair<std::string, std::string>> properties;
};

// The document: one <testsuite> named `suite` with its counts and `properties` (provenance), inside <testsuites>.
std::string junit_xml(const std::string& suite, const std::vector<JUnitCase>& cases,
                      const std::vector<std::pair<std::string, std::string>>& properties);
// Written atomically (temporary file, then rename): a CI never reads half a report.
void write_junit(const std::filesystem::path& file, const std::string& suite, const std::vector<JUnitCase>& cases,
                 const std::vector<std::pair<std::string, std::string>>& properties);

}  // namespace sbp
