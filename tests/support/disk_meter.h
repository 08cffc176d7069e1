// The file tier's bytes on disk, measured (issue #61): the blocks its files take on the file system, beside what the
// tier counts (OffloadTier::held_bytes) and what the models say (memory::offload_disk_terms). The tier's files are
// unnamed (O_TMPFILE, or unlinked at once) and closed once mapped, so they are found through this process's
// mappings (/proc/self/maps, the mapped file's folder) and stat'ed through /proc/self/map_files.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "core/offload/offload_tier.h"

namespace sbp::test {

// Allocated bytes (st_blocks x 512) of every distinct file in `dir` mapped into this process now.
std::int64_t mapped_disk_bytes(const std::filesystem::path& dir);

// A tier that measures the disk after every store and every zeros() (where its files appear), keeping the largest
// value: the files' peak on disk over the run. It counts its tensors' bytes as the real tier does (held_bytes). With `leak_second`, the fault of a tier that leaks: the second store
// is copied twice and the extra file kept for the tier's life (a negative control, never a production tier).
class DiskMeteredTier final : public OffloadTier {
 public:
  DiskMeteredTier(std::unique_ptr<OffloadTier> real, std::filesystem::path dir, bool leak_second = false);
  std::string describe() const override { return "disk-metered " + real_->describe(); }
  at::Tensor store(const at::Tensor& device) override;
  at::Tensor fetch(const at::Tensor& host, c10::Device device) override { return real_->fetch(host, device); }
  at::Tensor zeros(at::IntArrayRef sizes, c10::ScalarType dtype) override;
  std::int64_t peak_disk_bytes() const { return peak_disk_; }
  std::int64_t files_at_peak() const { return files_at_peak_; }

 private:
  void measure();
  std::unique_ptr<OffloadTier> real_;
  std::filesystem::path dir_;
  bool leak_second_;
  int stores_ = 0;
  at::Tensor leaked_;
  std::int64_t peak_disk_ = 0, files_at_peak_ = 0;
};

}  // namespace sbp::test
