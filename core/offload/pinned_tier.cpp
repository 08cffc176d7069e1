// The CUDA offload tier: pinned host memory, and every copy on a side stream of the device, so that moving a
// checkpoint out or the next one in overlaps the kernels of the current layer. Order, without synchronising the host:
// a store waits (on the side stream) for the work that made its tensor, and record_stream keeps that tensor's memory
// from being reused until the copy is done; a fetch copies into memory allocated on the compute stream and records
// an event that ready() makes the compute stream wait for, just before the first use. The copies are byte copies:
// bitwise the tensors that went out. Compiled in CI (CUDA toolkit, no GPU); run only by tests/gpu/run.sh.
#include <map>
#include <utility>
#include <vector>
#include <stdexcept>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "core/offload/offload_tier.h"
#include "core/io/input_error.h"

namespace sbp {
namespace {

// A CUDA event without timing, written here: ATen's CUDAEvent header pulls in cuBLAS's, which a toolkit without its
// math libraries lacks.
class Event {
 public:
  Event() { C10_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
  ~Event() { cudaEventDestroy(event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(const c10::cuda::CUDAStream& stream) { C10_CUDA_CHECK(cudaEventRecord(event_, stream.stream())); }
  void block(const c10::cuda::CUDAStream& stream) const { C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), event_, 0)); }

 private:
  cudaEvent_t event_{};
};

class PinnedTier final : public OffloadTier {
 public:
  explicit PinnedTier(c10::Device device)
      : device_(device), side_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())) {}
  std::string describe() const override { return "pinned host memory, copies on a side stream of " + device_.str(); }

  at::Tensor store(const at::Tensor& device) override {
    const c10::cuda::CUDAGuard guard(device_);
    auto host = tracked(at::empty(device.sizes(), device.options().device(c10::kCPU).pinned_memory(true)));
    Event made;
    made.record(c10::cuda::getCurrentCUDAStream(device_.index()));
    made.block(side_);
    {
      const c10::cuda::CUDAStreamGuard on_side(side_);
      host.copy_(device, /*non_blocking=*/true);
    }
    device.record_stream(side_.unwrap());
    return host;
  }

  at::Tensor fetch(const at::Tensor& host, c10::Device device) override {
    const c10::cuda::CUDAGuard guard(device);
    const auto compute = c10::cuda::getCurrentCUDAStream(device.index());
    auto out = at::empty(host.sizes(), host.options().device(device).pinned_memory(false));
    Event allocated;
    allocated.record(compute);
    allocated.block(side_);
    {
      const c10::cuda::CUDAStreamGuard on_side(side_);
      out.copy_(host, /*non_blocking=*/true);
    }
    out.record_stream(side_.unwrap());
    pending_[out.data_ptr()].record(side_);
    return out;
  }

  at::Tensor zeros(at::IntArrayRef sizes, c10::ScalarType dtype) override {
    return tracked(at::zeros(sizes, at::TensorOptions().dtype(dtype).pinned_memory(true)));
  }

  void ready(const at::Tensor& fetched) override {
    const auto it = pending_.find(fetched.data_ptr());
    if (it == pending_.end()) return;
    it->second.block(c10::cuda::getCurrentCUDAStream(device_.index()));
    pending_.erase(it);
  }

 private:
  // The host allocator owns the pinned blocks (and the events that keep one from reuse while a copy runs), so their
  // bytes are counted out when their storage is found dead, before the next one is made: the peak, reached when one
  // is made, is exact.
  at::Tensor tracked(at::Tensor host) {
    forget_dead();
    const auto bytes = std::int64_t(host.nbytes());
    bytes_->add(bytes);
    alive_.push_back({c10::weak_intrusive_ptr<c10::StorageImpl>(host.storage().getWeakStorageImpl()), bytes});
    return host;
  }
  void forget_dead() {
    std::vector<std::pair<c10::weak_intrusive_ptr<c10::StorageImpl>, std::int64_t>> still;
    for (auto& [storage, bytes] : alive_)
      if (storage.expired())
        bytes_->add(-bytes);
      else
        still.emplace_back(std::move(storage), bytes);
    alive_ = std::move(still);
  }

  c10::Device device_;
  c10::cuda::CUDAStream side_;
  std::map<const void*, Event> pending_;
  std::vector<std::pair<c10::weak_intrusive_ptr<c10::StorageImpl>, std::int64_t>> alive_;
};

}  // namespace

std::unique_ptr<OffloadTier> make_pinned_tier(c10::Device device) {
  if (!device.is_cuda()) throw InputError("make_pinned_tier: " + device.str() + " is not a CUDA device");
  return std::make_unique<PinnedTier>(device);
}

}  // namespace sbp
