// The build without oneDNN (STREAMBP_WITH_ONEDNN=OFF, or libdnnl-dev missing): the CPU's bf16 attention keeps its fp32
// blocks.
#include "core/onednn/bf16_matmul.h"

#include <stdexcept>

namespace sbp::onednn {

bool bf16_native() { return false; }
std::string describe() { return "no oneDNN in this build (libdnnl-dev)"; }
std::size_t scratchpad_bytes(const MatmulShape&) { return 0; }
void matmul(const MatmulShape&, const std::uint16_t*, const std::uint16_t*, float*, void*) {
  throw std::runtime_error("bf16 matmul: this build has no oneDNN (install libdnnl-dev and reconfigure)");
}

}  // namespace sbp::onednn
