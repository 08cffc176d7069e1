// Reading an implementation's result.json (docs/conformance.md, "The protocol"): its loss, the CPU seconds of a warm
// worker, the interpreter and torch that computed the gradients, and how many micro-batches ran.
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "verify/conformance.h"

namespace sbp {

namespace {

// result.json as JSON. Python's json.dumps writes a non-finite float as a bare NaN, Infinity or -Infinity, which JSON
// does not have: quote those tokens (outside strings); result_loss reads a quoted one back as its number.
nlohmann::json python_json(const std::string& text) {
  std::string quoted;
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      quoted += c;
      if (c == '\\' && i + 1 < text.size()) quoted += text[++i];
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    bool replaced = false;
    for (const std::string token : {"NaN", "Infinity", "-Infinity"})
      if (text.compare(i, token.size(), token) == 0) {
        quoted += '"' + token + '"';
        i += token.size() - 1;
        replaced = true;
        break;
      }
    if (!replaced) quoted += c;
  }
  return nlohmann::json::parse(quoted);
}

}  // namespace

double result_loss(const std::string& text) {
  const auto loss = python_json(text).at("loss");
  if (loss.is_string()) {
    const auto word = loss.get<std::string>();
    if (word == "NaN") return std::numeric_limits<double>::quiet_NaN();
    if (word == "Infinity") return std::numeric_limits<double>::infinity();
    if (word == "-Infinity") return -std::numeric_limits<double>::infinity();
  }
  return loss.get<double>();
}

double result_worker_cpu_seconds(const std::string& text) {
  try {
    const auto j = python_json(text);
    if (!j.contains("cpu_seconds") || !j["cpu_seconds"].is_number()) return 0;
    const double seconds = j["cpu_seconds"].get<double>();
    return std::isfinite(seconds) && seconds > 0 ? seconds : 0;
  } catch (const nlohmann::json::exception&) {
    return 0;
  }
}

ImplementationProvenance result_provenance(const std::string& text) {
  ImplementationProvenance p;
  try {
    const auto j = python_json(text);
    if (j.contains("python") && j["python"].is_string()) p.python = j["python"].get<std::string>();
    if (j.contains("torch_version") && j["torch_version"].is_string())
      p.torch_version = j["torch_version"].get<std::string>();
  } catch (const nlohmann::json::exception&) {
  }
  return p;
}

std::string result_micro_batches_problem(const std::string& text, std::size_t expected) {
  const auto j = python_json(text);
  const auto how = fmt::format("the case's step is {} micro-batches (case.json micro_batches): an implementation "
                               "runs them and says how many ran (README: Conformance)", expected);
  if (!j.contains("micro_batches")) return "result.json has no \"micro_batches\"; " + how;
  const auto& v = j["micro_batches"];
  if (!v.is_number_integer()) return "result.json: \"micro_batches\" is " + v.dump() + ", not an integer; " + how;
  if (v.get<std::int64_t>() != std::int64_t(expected))
    return fmt::format("result.json: {} micro-batches ran; {}", v.get<std::int64_t>(), how);
  return "";
}

}  // namespace sbp
