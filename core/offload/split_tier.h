// The third tier at run time (issue #61): a host tier for what is stored first, up to a byte budget, and a disk tier
// (the file tier in a folder on node-local disk) for the rest, so that the layer checkpoints H[0..k) stay in host
// memory and H[k..L-1] go to disk, the placement the memory models give Offload::host_layers = k (offload_memory.cpp)
// for k = budget / one checkpoint's bytes. Copies only, as every tier: bitwise the run without offload.
#pragma once

#include <cstdint>
#include <memory>

#include "core/offload/offload_tier.h"

namespace sbp {

// A store goes to `host` while what `host` then holds stays within `host_bytes`, else to `disk`; fetch and ready go
// through `host` (a copy from either kind of memory). The split tier counts both tiers' bytes (held, peak).
std::unique_ptr<OffloadTier> make_split_tier(std::unique_ptr<OffloadTier> host, std::unique_ptr<OffloadTier> disk,
                                             std::int64_t host_bytes);

}  // namespace sbp
