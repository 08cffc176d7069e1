// How a sequence-parallel group exchanges K/V (--sp-scheme, ARCHITECTURE.md §16): the all-gather (every rank holds a
// layer's whole K/V and their sums: core/training/sequence_parallel.h) or the ring over key blocks (no rank holds
// them: core/training/ring_exchange.h).
#pragma once

#include <string>

#include "core/model/sequence_shard.h"

namespace sbp {

SequenceScheme parse_sequence_scheme(const std::string& name);  // InputError naming --sp-scheme
const char* sequence_scheme_name(SequenceScheme scheme);

}  // namespace sbp
