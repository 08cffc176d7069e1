// make_nccl_communicator (c10d_communicator.h): ProcessGroupNCCL on one CUDA device per rank, the store and the
// Communicator shared with Gloo (c10d_backend.h). Compiled only when STREAMBP_WITH_CUDA is ON (nccl.h from the torch
// wheel's nvidia-nccl package, found by core/CMakeLists.txt); nccl_communicator_stub.cpp otherwise.
#include <stdexcept>
#include <string>

#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>

#ifndef USE_C10D_NCCL
// Set by torch's torch_cuda target (INTERFACE_COMPILE_DEFINITIONS); without it ProcessGroupNCCL.hpp declares nothing.
#error "USE_C10D_NCCL is not defined: this torch has no NCCL backend (link the CUDA build's torch_cuda)"
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "core/training/c10d_backend.h"
#include "core/io/input_error.h"

namespace sbp {
namespace {

// Empty when CUDA device `index` is usable by this process, otherwise why not. Asks the runtime directly rather than
// c10::cuda::device_count(), which reports 0 without saying why; never initialises torch's CUDA state.
std::string why_no_device(int index) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it, or torch's next CUDA call would report it as its own
    return std::string("no CUDA device is available (cudaGetDeviceCount failed with ") + cudaGetErrorName(err) +
           ": " + cudaGetErrorString(err) + ")";
  }
  if (count == 0) return "no CUDA device is available (cudaGetDeviceCount found 0)";
  if (index < 0 || index >= count)
    return "no CUDA device " + std::to_string(index) + " (this process has " + std::to_string(count) + ")";
  return {};
}

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(const RendezvousOptions& o, int device_index) {
  if (const auto why = why_no_device(device_index); !why.empty())
    throw InputError("rank " + std::to_string(o.rank) + " of " + std::to_string(o.world_size) +
                             ": NCCL needs a CUDA device per rank, and " + why);
  const c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_index));
  c10::cuda::set_device(device.index());  // NCCL's streams and this thread's kernels on the rank's device
  const auto timeout = o.timeout;
  const detail::BackendFactory nccl = [timeout, device](const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                         int size) {
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
    // As init_process_group(device_id=...): the group is bound to the device (barrier() uses it) and its NCCL
    // communicator formed now, so a rank that never arrives fails here rather than in the first collective.
    group->setBoundDeviceId(device);
    group->eagerConnectSingleDevice(device);
    return c10::intrusive_ptr<c10d::Backend>(std::move(group));
  };
  return detail::make_backend_communicator(nccl, o, device, /*copies_buffers=*/false);
}

}  // namespace sbp
