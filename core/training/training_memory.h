// The analytic peak of a training step (ARCHITECTURE.md §11): a method's BP moments with the optimizer's states beside
// them, or the optimizer's update, whichever is larger, with the moments the features add around the update (data
// parallelism's norm and gather).
#pragma once

#include "core/methods/method.h"

namespace sbp {

// A training step of `method`: its BP moments with the optimizer's states beside them, or the optimizer's update
// (weights, every gradient, the states and the update's temporaries), whichever is larger. Without optimizer bytes
// in the workload: the method's own model.
MemoryEstimate training_memory(const BackpropMethod& method, const Workload& w);

}  // namespace sbp
