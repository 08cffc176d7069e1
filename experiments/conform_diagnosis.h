// What a failing fp64 conform case's gradients are when they are not the oracle's (issue #62): conform knows the
// case's tiles, so it tries the bugs that live at their boundaries as changed oracles on the case's own files.
#pragma once

#include <filesystem>
#include <string>

#include "core/io/safetensors.h"
#include "verify/conformance.h"

namespace sbp {

struct Batch;

// SFT only: the oracle with the target that crosses each tile boundary dropped (the label at every multiple of the
// head's or the layer's chunk but 0), normalised by the targets left or by all of them. That is what a loss that
// shifts its labels inside each tile after splitting computes. When one of them agrees with `got` to 1e-8 while the
// oracle does not (`worst`: its error), the hint says so; empty otherwise.
std::string tile_boundary_hint(const ConformCase& c, const std::filesystem::path& dir, const Batch& batch,
                               const TensorList& got, double worst);

}  // namespace sbp
