#include "experiments/junit.h"

#include <fmt/format.h>

#include "core/io/safetensors.h"

namespace sbp {
namespace {

// XML 1.0 attribute and text escaping; control characters other than tab/newline are not allowed in XML 1.0 at all
// (an implementation's log line may carry them), so they become '?'.
std::string escaped(const std::string& s) {
  std::string out;
  for (const char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      case '\n': out += "&#10;"; break;
      case '\t': out += "&#9;"; break;
      default: out += static_cast<unsigned char>(c) < 0x20 ? '?' : c;
    }
  }
  return out;
}

}  // namespace

std::string junit_xml(const std::string& suite, const std::vector<JUnitCase>& cases,
                      const std::vector<std::pair<std::string, std::string>>& properties) {
  int failures = 0, skipped = 0;
  double seconds = 0;
  for (const auto& c : cases) {
    failures += c.status == JUnitCase::Status::failed;
    skipped += c.status == JUnitCase::Status::skipped;
    seconds += c.seconds;
  }
  std::string xml = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  xml += fmt::format("<testsuites name=\"{0}\" tests=\"{1}\" failures=\"{2}\" errors=\"0\" skipped=\"{3}\" "
                     "time=\"{4:.3f}\">\n", escaped(suite), cases.size(), failures, skipped, seconds);
  xml += fmt::format("  <testsuite name=\"{0}\" tests=\"{1}\" failures=\"{2}\" errors=\"0\" skipped=\"{3}\" "
                     "time=\"{4:.3f}\">\n", escaped(suite), cases.size(), failures, skipped, seconds);
  xml += "    <properties>\n";
  for (const auto& [key, value] : properties)
    xml += fmt::format("      <property name=\"{}\" value=\"{}\"/>\n", escaped(key), escaped(value));
  xml += "    </properties>\n";
  for (const auto& c : cases) {
    xml += fmt::format("    <testcase classname=\"{}\" name=\"{}\" time=\"{:.3f}\"", escaped(c.classname),
                       escaped(c.name), c.seconds);
    if (c.status == JUnitCase::Status::passed && c.properties.empty()) {
      xml += "/>\n";
      continue;
    }
    xml += ">\n";
    if (!c.properties.empty()) {
      xml += "      <properties>\n";
      for (const auto& [key, value] : c.properties)
        xml += fmt::format("        <property name=\"{}\" value=\"{}\"/>\n", escaped(key), escaped(value));
      xml += "      </properties>\n";
    }
    if (c.status == JUnitCase::Status::skipped)
      xml += fmt::format("      <skipped message=\"{}\"/>\n", escaped(c.message));
    else if (c.status == JUnitCase::Status::failed)
      xml += fmt::format("      <failure message=\"{}\" type=\"incorrect\">{}</failure>\n", escaped(c.message),
                         escaped(c.details));
    xml += "    </testcase>\n";
  }
  return xml + "  </testsuite>\n</testsuites>\n";
}

void write_junit(const std::filesystem::path& file, const std::string& suite, const std::vector<JUnitCase>& cases,
                 const std::vector<std::pair<std::string, std::string>>& properties) {
  if (file.has_parent_path()) std::filesystem::create_directories(file.parent_path());
  write_file_atomically(file, junit_xml(suite, cases, properties));
}

}  // namespace sbp
