// The pinned-memory tier without the CUDA half (STREAMBP_WITH_CUDA off): a CUDA device cannot be reached here anyway.
#include <stdexcept>

#include "core/offload/offload_tier.h"
#include "core/io/input_error.h"

namespace sbp {

std::unique_ptr<OffloadTier> make_pinned_tier(c10::Device device) {
  throw InputError("--offload on " + device.str() + ": this build has no CUDA half (STREAMBP_WITH_CUDA=OFF)");
}

}  // namespace sbp
