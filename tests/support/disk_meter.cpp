#include "tests/support/disk_meter.h"

#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>

#include <ATen/ATen.h>
#include <sys/stat.h>

namespace sbp::test {
namespace {

// Each mapping of a file in `dir`: its address range (the name under /proc/self/map_files) and inode.
struct Mapping {
  std::string range;
  std::uint64_t inode;
};
std::vector<Mapping> mappings_in(const std::filesystem::path& dir) {
  std::ifstream maps("/proc/self/maps");
  if (!maps) throw std::runtime_error("disk meter: cannot read /proc/self/maps");
  const std::string prefix = std::filesystem::weakly_canonical(dir).string() + "/";
  std::vector<Mapping> out;
  for (std::string line; std::getline(maps, line);) {
    // address perms offset dev inode path
    std::istringstream in(line);
    std::string range, perms, offset, dev, path;
    std::uint64_t inode = 0;
    in >> range >> perms >> offset >> dev >> inode;
    std::getline(in >> std::ws, path);
    if (inode != 0 && path.rfind(prefix, 0) == 0) out.push_back({range, inode});
  }
  return out;
}

std::pair<std::int64_t, std::int64_t> measure_dir(const std::filesystem::path& dir) {
  std::set<std::uint64_t> seen;
  std::int64_t bytes = 0, files = 0;
  for (const auto& m : mappings_in(dir)) {
    if (!seen.insert(m.inode).second) continue;
    struct stat st{};
    if (::stat(("/proc/self/map_files/" + m.range).c_str(), &st) != 0)
      throw std::runtime_error("disk meter: cannot stat /proc/self/map_files/" + m.range);
    bytes += std::int64_t(st.st_blocks) * 512;
    ++files;
  }
  return {bytes, files};
}

}  // namespace

std::int64_t mapped_disk_bytes(const std::filesystem::path& dir) { return measure_dir(dir).first; }

DiskMeteredTier::DiskMeteredTier(std::unique_ptr<OffloadTier> real, std::filesystem::path dir, bool leak_second)
    : real_(std::move(real)), dir_(std::move(dir)), leak_second_(leak_second) {}

at::Tensor DiskMeteredTier::store(const at::Tensor& device) {
  auto host = real_->store(device);
  if (leak_second_ && ++stores_ == 2) leaked_ = real_->store(device);
  measure();
  return counted(std::move(host));
}

at::Tensor DiskMeteredTier::zeros(at::IntArrayRef sizes, c10::ScalarType dtype) {
  auto t = real_->zeros(sizes, dtype);
  measure();
  return counted(std::move(t));
}

void DiskMeteredTier::measure() {
  const auto [bytes, files] = measure_dir(dir_);
  if (bytes > peak_disk_) {
    peak_disk_ = bytes;
    files_at_peak_ = files;
  }
}

}  // namespace sbp::test
