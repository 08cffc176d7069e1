#include "experiments/provenance.h"

#include <array>
#include <chrono>
#include <filesystem>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <memory>
#include <thread>

#include <unistd.h>

#include <ATen/Parallel.h>
#include <torch/headeronly/version.h>

#include "profiler/calibration.h"

namespace sbp {
namespace {

std::string shell_output(const std::string& cmd) {
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(cmd.c_str(), "r"), pclose);
  if (!pipe) return "";
  std::string out;
  std::array<char, 256> buf{};
  while (fgets(buf.data(), int(buf.size()), pipe.get())) out += buf.data();
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown cpu";
}

}  // namespace

std::string harness_path(const std::string& relative) {
  return (std::filesystem::path(STREAMBP_SOURCE_DIR) / relative).string();
}

Provenance collect_provenance(const std::string& command, const std::string& device) {
  Provenance p;
  const std::string src = STREAMBP_SOURCE_DIR;
  p.commit = shell_output("git -C '" + src + "' rev-parse --short=12 HEAD 2>/dev/null");
  if (p.commit.empty()) p.commit = "unknown";
  else if (!shell_output("git --no-optional-locks -C '" + src + "' status --porcelain --untracked-files=no 2>/dev/null").empty())
    p.commit += "+dirty";
  const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&now, &tm);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &tm);
  p.date_utc = date;
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  p.machine = std::string(host) + " / " + cpu_model() + " / " + std::to_string(std::thread::hardware_concurrency()) +
              " cores / " + cpu_isa_summary() + (device.empty() || device == "cpu" ? std::string() : " / " + device);
  p.threads = at::get_num_threads();
  p.torch_version = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
                    std::to_string(TORCH_VERSION_PATCH);
  p.command = command;
  return p;
}

nlohmann::json to_json(const Provenance& p) {
  return {{"commit", p.commit}, {"date", p.date_utc}, {"machine", p.machine}, {"threads", p.threads},
          {"torch_version", p.torch_version}, {"command", p.command}};
}

std::string shell_quote(const std::string& word) {
  const bool plain = !word.empty() && word.find_first_not_of(
      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./:=,+@%") == std::string::npos;
  if (plain) return word;
  std::string q = "'";
  for (char ch : word) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return q + "'";
}

std::string shell_quote_argv(int argc, char** argv) {
  std::string out;
  for (int i = 0; i < argc; ++i) out += (i ? " " : "") + shell_quote(argv[i]);
  return out;
}

}  // namespace sbp
