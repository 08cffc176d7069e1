// The kinds of state that can move to the offload tier: one enum for the flags that name them (experiments'
// --offload), the trainer's features and the memory models' Workload.
#pragma once

namespace sbp {

// What moves to the offload tier (core/offload/offload_tier.h):
// - checkpoints: the layer checkpoints (core/methods/layer_checkpoints.h): on the device only the one in use and the
//   one fetched ahead of it;
// - optimizer: the optimizer's states (Optimizer's states_tier), the update where they are (its temporaries on the
//   device, as on the CPU; a GPU's would be the host's: counted on the device, an upper bound there);
// - gradients: each group's at its gradient-ready event of the step's last micro-batch (the reduced ones when
//   data-parallel: this rank's slices at ZeRO 2-3), in the tier until the next step frees them; between
//   micro-batches they stay on the device, where the method adds into them;
// - parameters: the trainable tensors between their uses (one process: ParameterHome; ZeRO-3: this rank's slices,
//   which a layer's gather reads from there).
enum class OffloadKind { checkpoints, optimizer, gradients, parameters };

}  // namespace sbp
