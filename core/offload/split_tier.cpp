#include "core/offload/split_tier.h"

#include <string>

#include <ATen/ATen.h>
#include <fmt/format.h>

namespace sbp {
namespace {

class SplitTier final : public OffloadTier {
 public:
  SplitTier(std::unique_ptr<OffloadTier> host, std::unique_ptr<OffloadTier> disk, std::int64_t host_bytes)
      : host_(std::move(host)), disk_(std::move(disk)), host_bytes_(host_bytes) {}
  std::string describe() const override {
    return fmt::format("{} up to {} bytes, then {}", host_->describe(), host_bytes_, disk_->describe());
  }
  at::Tensor store(const at::Tensor& device) override { return counted(where(device.nbytes()).store(device)); }
  at::Tensor fetch(const at::Tensor& host, c10::Device device) override { return host_->fetch(host, device); }
  void ready(const at::Tensor& fetched) override { host_->ready(fetched); }
  at::Tensor zeros(at::IntArrayRef sizes, c10::ScalarType dtype) override {
    std::int64_t numel = 1;
    for (const auto s : sizes) numel *= s;
    return counted(where(std::size_t(numel) * c10::elementSize(dtype)).zeros(sizes, dtype));
  }

 private:
  OffloadTier& where(std::size_t bytes) {
    return host_->held_bytes() + std::int64_t(bytes) <= host_bytes_ ? *host_ : *disk_;
  }
  std::unique_ptr<OffloadTier> host_, disk_;
  std::int64_t host_bytes_;
};

}  // namespace

at::Tensor OffloadTier::counted(at::Tensor t) {
  const auto bytes = std::int64_t(t.nbytes());
  if (bytes == 0) return t;
  bytes_->add(bytes);
  void* data = t.data_ptr();
  const auto sizes = t.sizes().vec();
  const auto options = t.options();
  return at::from_blob(
      data, sizes,
      [held = std::move(t), counter = bytes_, bytes](void*) mutable {
        held.reset();
        counter->add(-bytes);
      },
      options);
}

std::unique_ptr<OffloadTier> make_split_tier(std::unique_ptr<OffloadTier> host, std::unique_ptr<OffloadTier> disk,
                                             std::int64_t host_bytes) {
  return std::make_unique<SplitTier>(std::move(host), std::move(disk), host_bytes);
}

}  // namespace sbp
