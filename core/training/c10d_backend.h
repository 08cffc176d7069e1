// Private to the two translation units that include c10d's headers (c10d_communicator.cpp: Gloo, the store and the
// shared Communicator; nccl_communicator.cpp: NCCL). What both backends share: the rendezvous store, the Communicator
// over any c10d::Backend (accounting, and every wait() wrapped into a std::runtime_error naming the rank and the
// collective), and the message of a group that could not be formed. Nothing else may include this header.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "core/training/c10d_communicator.h"

namespace sbp::detail {

// A FileStore at options.file_store, else a TCPStore at master_addr:master_port (rank 0 serves it), with the timeout.
c10::intrusive_ptr<c10d::Store> make_store(const RendezvousOptions& options);

// A c10d backend of `rank` in `size` ranks rendezvousing through `store`: the one thing Gloo and NCCL form
// differently. Called for the whole group and again for each subgroup (through a PrefixStore of its name).
using BackendFactory =
    std::function<c10::intrusive_ptr<c10d::Backend>(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size)>;

// The Communicator of options.rank in options.world_size, its backend made by `factory` over make_store(options), its
// collectives' tensors on `device`; copies_buffers: Communicator::copies_collective_buffers of the backend. Throws
// std::runtime_error (rendezvous_failure) when the group cannot be formed.
std::unique_ptr<Communicator> make_backend_communicator(const BackendFactory& factory, const RendezvousOptions& options,
                                                        c10::Device device, bool copies_buffers);

// "rank r of n: no process group through <store> within the timeout: <first line of what>".
std::string rendezvous_failure(const RendezvousOptions& options, const std::string& what);

}  // namespace sbp::detail
