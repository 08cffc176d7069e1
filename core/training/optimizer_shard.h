// The optimizer's share of the memory models: what rank 0's optimizer holds under a ZeRO stage, and the optimizer
// bytes of a projected workload. Here, above the methods, because it needs the optimizer's own accounting
// (optimizer_memory); the methods' models only read the bytes it leaves in the Workload.
#pragma once

#include <vector>

#include "core/methods/method.h"
#include "core/training/optimizer.h"

namespace sbp {

// The optimizer's bytes of a workload that has no model to look at (projections): its trainable elements (every
// weight, or the LoRA adapters) as tensors no larger than the largest one (the [V, d] embedding, or a rank x I
// adapter), in the gradient dtype. Exact for the states; the update's temporaries follow the largest tensor.
// Data-parallel at ZeRO stage >= 1 (Workload::world_size, zero_stage): this rank's slice of each tensor.
void add_projected_optimizer(Workload& w, const OptimizerOptions& options);
// What the optimizer of rank 0 holds under w's ZeRO stage: each tensor's slice of ceil(numel / N) elements
// (DataParallel::optimizer_params) at stages >= 1, `params` unchanged otherwise.
std::vector<ParamShape> optimizer_shard(const std::vector<ParamShape>& params, const Workload& w);

}  // namespace sbp
