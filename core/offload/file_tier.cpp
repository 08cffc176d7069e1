// The CPU's offload tier: every stored tensor is an unnamed file in the offload folder, memory-mapped. Its pages are
// the kernel's page cache, not the process's allocator, so the meter (which sees every tensor byte the allocator
// hands out) no longer counts them, and under memory pressure the kernel writes them to disk instead of the run
// failing: a CPU run can hold more than its RAM, as ZeRO-Infinity's NVMe tier holds more than the GPU.
#include "core/offload/offload_tier.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include <ATen/ATen.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>
#include "core/io/input_error.h"

namespace sbp {
namespace {

class FileTier final : public OffloadTier {
 public:
  explicit FileTier(std::string dir) : dir_(std::move(dir)) {}
  std::string describe() const override { return "memory-mapped files in " + dir_; }

  at::Tensor store(const at::Tensor& device) override {
    auto host = allocate(device.sizes(), device.scalar_type());
    host.copy_(device);
    return host;
  }
  at::Tensor fetch(const at::Tensor& host, c10::Device device) override {
    return host.to(at::TensorOptions().device(device), /*non_blocking=*/false, /*copy=*/true);
  }
  // A reserved file reads as zeros (posix_fallocate's blocks are zero-filled): no page is touched until used.
  at::Tensor zeros(at::IntArrayRef sizes, c10::ScalarType dtype) override { return allocate(sizes, dtype); }

  // An uninitialised tensor backed by a file of its size: unnamed (O_TMPFILE; else made and unlinked at once), so
  // nothing is left behind however the run ends, and its blocks reserved up front (posix_fallocate), so that a full
  // disk is an error here, naming the folder, and never a SIGBUS when a page is first written.
  at::Tensor allocate(at::IntArrayRef sizes, c10::ScalarType dtype) {
    const auto options = at::TensorOptions().dtype(dtype);
    std::int64_t numel = 1;
    for (const auto s : sizes) numel *= s;
    const auto bytes = numel * std::int64_t(c10::elementSize(dtype));
    if (bytes == 0) return at::empty(sizes, options);
    const int fd = open_file();
    if (const int err = posix_fallocate(fd, 0, off_t(bytes)); err != 0) {
      ::close(fd);
      throw InputError(fmt::format("--offload-dir {}: cannot reserve {} bytes for an offloaded tensor ({}); "
                                           "free space there or choose another folder", dir_, bytes, std::strerror(err)));
    }
    void* data = ::mmap(nullptr, std::size_t(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int mmap_errno = errno;
    ::close(fd);  // the mapping keeps the file
    if (data == MAP_FAILED)
      throw InputError(fmt::format("--offload-dir {}: cannot map {} bytes ({})", dir_, bytes,
                                           std::strerror(mmap_errno)));
    bytes_->add(bytes);
    return at::from_blob(
        data, sizes,
        [counter = bytes_, bytes](void* p) {
          ::munmap(p, std::size_t(bytes));
          counter->add(-bytes);
        },
        options);
  }

 private:
  int open_file() const {
    int fd = ::open(dir_.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {  // a file system without O_TMPFILE
      auto path = (std::filesystem::path(dir_) / "streambp-offload-XXXXXX").string();
      fd = ::mkstemp(path.data());
      if (fd >= 0) ::unlink(path.c_str());
    }
    if (fd < 0)
      throw InputError(fmt::format("--offload-dir {}: cannot create a file there ({})", dir_, std::strerror(errno)));
    return fd;
  }

  std::string dir_;
};

}  // namespace

std::unique_ptr<OffloadTier> make_file_tier(const std::string& dir) {
  if (!std::filesystem::is_directory(dir))
    throw InputError("--offload-dir " + dir + ": no such folder");
  auto tier = std::make_unique<FileTier>(dir);
  // Writable, with room for a page: found now, before any work, not in the middle of a step.
  try {
    (void)tier->store(at::zeros({4096}, at::kByte));
  } catch (const std::runtime_error& e) {
    throw InputError(e.what());
  }
  tier->reset_peak();
  return tier;
}

std::unique_ptr<OffloadTier> make_offload_tier(c10::Device device, const std::string& dir) {
  if (device.is_cpu()) return make_file_tier(dir);
  if (device.is_cuda()) return make_pinned_tier(device);
  throw InputError("--offload: no offload tier for device " + device.str());
}

}  // namespace sbp
