// The Communicator over torch's c10d: ProcessGroupGloo on the CPU (loopback) or ProcessGroupNCCL on a CUDA device,
// rendezvous through a FileStore (a file in a fresh temporary directory: no ports, so concurrent runs never collide)
// or a TCPStore (torchrun's MASTER_ADDR / MASTER_PORT). c10d's headers are included by two translation units only:
// c10d_communicator.cpp (Gloo, the stores, the shared Communicator) and nccl_communicator.cpp (NCCL; compiled when
// STREAMBP_WITH_CUDA is ON, nccl_communicator_stub.cpp otherwise).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "core/training/communicator.h"

namespace sbp {

struct RendezvousOptions {
  int rank = 0, world_size = 1;
  std::string file_store;             // a FileStore at this path, or
  std::string master_addr;            // a TCPStore at master_addr:master_port (rank 0 serves it)
  int master_port = 0;
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // every collective and the rendezvous
};

// Throws PeerFailure naming the rank and the store when the group cannot be formed within the timeout.
// A collective whose peer died or stalled throws PeerFailure (naming the collective) within the timeout.
std::unique_ptr<Communicator> make_gloo_communicator(const RendezvousOptions& options);

// The same over NCCL, the collectives' tensors on CUDA device `device_index` (which becomes this thread's current
// device). Throws InputError naming the rank, before any rendezvous, when this process has no CUDA device or
// not that one, and in a build without CUDA; as make_gloo_communicator when the group cannot be formed. A collective
// that outlives the timeout makes NCCL's watchdog abort the process (TORCH_NCCL_ASYNC_ERROR_HANDLING's default).
std::unique_ptr<Communicator> make_nccl_communicator(const RendezvousOptions& options, int device_index);

}  // namespace sbp
