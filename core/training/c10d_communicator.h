// The Communicator over torch's c10d: ProcessGroupGloo on the CPU (loopback), rendezvous through a FileStore (a file
// in a fresh temporary directory: no ports, so concurrent runs never collide) or a TCPStore (torchrun's MASTER_ADDR /
// MASTER_PORT). The one translation unit that includes c10d and Gloo headers.
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

// Throws std::runtime_error naming the rank and the store when the group cannot be formed within the timeout.
// A collective whose peer died or stalled throws std::runtime_error (naming the collective) within the timeout.
std::unique_ptr<Communicator> make_gloo_communicator(const RendezvousOptions& options);

}  // namespace sbp
