// make_nccl_communicator for builds without CUDA (STREAMBP_WITH_CUDA=OFF): there is no NCCL to form a group with.
#include <stdexcept>
#include <string>

#include "core/training/c10d_communicator.h"
#include "core/io/input_error.h"

namespace sbp {

std::unique_ptr<Communicator> make_nccl_communicator(const RendezvousOptions& options, int) {
  throw InputError("rank " + std::to_string(options.rank) + " of " + std::to_string(options.world_size) +
                           ": NCCL: this build has no CUDA (STREAMBP_WITH_CUDA=OFF)");
}

}  // namespace sbp
