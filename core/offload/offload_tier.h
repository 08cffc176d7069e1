// The second memory tier (ARCHITECTURE.md §15): tensors moved off the device and back by copies, never by
// arithmetic, so that a run with offload equals the run without it bitwise. One interface, two implementations:
// memory-mapped files on the CPU (file_tier.cpp: the bytes leave the metered pool and may exceed the machine's RAM, as
// ZeRO-Infinity's NVMe tier leaves the GPU), pinned host memory with copies on a side stream on CUDA
// (pinned_tier.cpp). Methods and the Trainer see only this.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include "core/io/input_error.h"

namespace sbp {

class OffloadTier {
 public:
  virtual ~OffloadTier() = default;
  // Where the bytes go, for a run's summary: "memory-mapped files in /tmp".
  virtual std::string describe() const = 0;

  // `device` copied into the tier (a new host tensor); the caller then drops its device tensor, whose memory the copy
  // no longer needs (on CUDA the copy is ordered after the work that made it, and holds it until done). Read the host
  // tensor directly only after the device is synchronised (CUDA: the copy may still run; fetch() is always ordered).
  virtual at::Tensor store(const at::Tensor& device) = 0;
  // A new tensor on `device` with `host`'s contents. The copy may still be running when this returns (CUDA: on the
  // tier's stream, overlapping the work queued before it): ready() before the first use.
  virtual at::Tensor fetch(const at::Tensor& host, c10::Device device) = 0;
  // The current stream waits for fetch()'s copy into `fetched` (the CPU copies at once: nothing to wait for).
  virtual void ready(const at::Tensor& fetched) {}
  // A host tensor of zeros that lives in the tier (the optimizer's states: the update runs where they are).
  virtual at::Tensor zeros(at::IntArrayRef sizes, c10::ScalarType dtype) = 0;

  // Bytes of the tier's tensors alive now, and the most there were since the last reset_peak().
  std::int64_t held_bytes() const { return bytes_->held; }
  std::int64_t peak_bytes() const { return bytes_->peak; }
  void reset_peak() { bytes_->peak = bytes_->held.load(); }

 protected:
  // The implementations' host tensors count their bytes here as they are made and die; a tensor's deleter holds the
  // counter, so a tensor may outlive the tier.
  struct Bytes {
    std::atomic<std::int64_t> held{0}, peak{0};
    void add(std::int64_t n) {
      const auto now = held += n;
      for (auto p = peak.load(); now > p && !peak.compare_exchange_weak(p, now);) {
      }
    }
  };
  std::shared_ptr<Bytes> bytes_ = std::make_shared<Bytes>();
  // A tier over other tiers (split_tier.cpp, the tests' metered tier): `t`, another tier's tensor, under a view that
  // counts its bytes here too; the view's deleter holds `t` (its memory lives until the view dies) and this counter.
  at::Tensor counted(at::Tensor t);
};

// The tier of a run on `device`: memory-mapped files in `dir` for the CPU (file_tier.cpp), pinned host memory for
// CUDA (pinned_tier.cpp; `dir` unused). Throws InputError naming the folder when it does not exist, is not
// writable or has no room for a page, and naming the device when it has no tier.
std::unique_ptr<OffloadTier> make_offload_tier(c10::Device device, const std::string& dir);

// Gradient offload: each of `params`' gradients moved into the tier (its grad() becomes the tier's copy, the device's
// is dropped). Called at a group's gradient-ready event, when the method no longer adds into it; the update then reads
// it where it is (Optimizer: from a GPU, a device copy of one tensor at a time).
inline void store_gradients(OffloadTier& tier, const std::vector<at::Tensor>& params) {
  for (const auto& p : params)
    if (p.grad().defined()) p.mutable_grad() = tier.store(p.grad());
}
std::unique_ptr<OffloadTier> make_file_tier(const std::string& dir);
std::unique_ptr<OffloadTier> make_pinned_tier(c10::Device device);

}  // namespace sbp
