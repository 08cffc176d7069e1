#include "experiments/available_memory.h"

#include <sys/resource.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include <fmt/format.h>

#include "experiments/measure.h"

namespace sbp {
namespace {

namespace fs = std::filesystem;

// The first number in a file ("max" or an unreadable file: none).
std::optional<std::int64_t> read_number(const fs::path& file) {
  std::ifstream in(file);
  std::int64_t value = 0;
  if (in >> value) return value;
  return std::nullopt;
}

// `key value` lines (memory.stat) and `Key: value kB` lines (/proc/meminfo, /proc/self/status): the value of `key`.
std::optional<std::int64_t> read_field(const fs::path& file, const std::string& key) {
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string name;
    std::int64_t value = 0;
    if (words >> name && (name == key || name == key + ":") && words >> value) {
      std::string unit;
      return words >> unit && unit == "kB" ? value * 1024 : value;
    }
  }
  return std::nullopt;
}

// This process's cgroup path in the hierarchy of `controller` ("" for v2's unified one), from /proc/self/cgroup.
std::optional<std::string> cgroup_path(const std::string& controller) {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    const auto first = line.find(':'), second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    std::istringstream names(line.substr(first + 1, second - first - 1));
    for (std::string name; std::getline(names, name, ',');)
      if (name == controller) return line.substr(second + 1);
    if (controller.empty() && second == first + 1) return line.substr(second + 1);
  }
  return std::nullopt;
}

// The folder of this process's cgroup under `mount`, or the mount itself inside a cgroup namespace (a container sees
// its own cgroup as the root).
fs::path cgroup_dir(const fs::path& mount, const std::string& path) {
  const auto dir = mount / fs::path(path).relative_path();
  std::error_code ec;
  return fs::is_directory(dir, ec) ? dir : mount;
}

constexpr std::int64_t kNoLimit = std::int64_t(1) << 60;  // v1 writes "no limit" as about 2^63

MemoryLimit limit_of(std::string name, std::int64_t limit, std::int64_t used, const std::string& used_what) {
  return {std::move(name), std::max<std::int64_t>(0, limit - used),
          fmt::format("limit {}, {} {}", format_bytes(limit), format_bytes(used), used_what)};
}

// cgroup v2: the tightest memory.max of this cgroup and its ancestors, against each one's usage.
std::optional<MemoryLimit> cgroup_v2_limit() {
  const auto path = cgroup_path("");
  if (!path || !fs::exists("/sys/fs/cgroup/cgroup.controllers")) return std::nullopt;
  std::optional<MemoryLimit> best;
  for (auto dir = cgroup_dir("/sys/fs/cgroup", *path);; dir = dir.parent_path()) {
    const auto max = read_number(dir / "memory.max"), current = read_number(dir / "memory.current");
    if (max && current) {
      const auto used = *current - read_field(dir / "memory.stat", "inactive_file").value_or(0);
      auto limit = limit_of("cgroup memory.max", *max, used, "used");
      if (!best || limit.left_bytes < best->left_bytes) best = std::move(limit);
    }
    if (dir == "/sys/fs/cgroup" || dir == dir.parent_path()) break;
  }
  return best;
}

// cgroup v1: memory.stat's hierarchical_memory_limit is already the tightest of the cgroup and its ancestors.
std::optional<MemoryLimit> cgroup_v1_limit() {
  const auto path = cgroup_path("memory");
  if (!path) return std::nullopt;
  const auto dir = cgroup_dir("/sys/fs/cgroup/memory", *path);
  const auto limit = read_field(dir / "memory.stat", "hierarchical_memory_limit");
  const auto usage = read_number(dir / "memory.usage_in_bytes");
  if (!limit || !usage || *limit >= kNoLimit) return std::nullopt;
  const auto used = *usage - read_field(dir / "memory.stat", "total_inactive_file").value_or(0);
  return limit_of("cgroup memory limit", *limit, used, "used");
}

}  // namespace

std::vector<MemoryLimit> memory_limits() {
  std::vector<MemoryLimit> limits;
  if (auto cgroup = cgroup_v2_limit()) limits.push_back(std::move(*cgroup));
  else if (auto v1 = cgroup_v1_limit()) limits.push_back(std::move(*v1));
  rlimit address_space{};
  if (getrlimit(RLIMIT_AS, &address_space) == 0 && address_space.rlim_cur != RLIM_INFINITY)
    if (const auto mapped = read_field("/proc/self/status", "VmSize"))
      limits.push_back(limit_of("ulimit -v", std::int64_t(std::min<rlim_t>(address_space.rlim_cur, kNoLimit)),
                                *mapped, "mapped"));
  if (const auto available = read_field("/proc/meminfo", "MemAvailable"))
    limits.push_back({"MemAvailable", *available, format_bytes(*available) + " in /proc/meminfo"});
  return limits;
}

const MemoryLimit* tightest_limit(const std::vector<MemoryLimit>& limits) {
  const MemoryLimit* best = nullptr;
  for (const auto& l : limits)
    if (!best || l.left_bytes < best->left_bytes) best = &l;
  return best;
}

}  // namespace sbp
