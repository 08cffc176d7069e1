// Names of the floating-point types a run can use ("fp64", "fp32", "bf16") and their HF spellings.
#pragma once

#include <string>

#include <c10/core/ScalarType.h>
#include "core/io/input_error.h"

namespace sbp {

c10::ScalarType parse_dtype(const std::string& name);  // Throws InputError naming the flag value
std::string dtype_name(c10::ScalarType dtype);          // "fp64", "fp32", "bf16", "fp16"
std::string hf_dtype_name(c10::ScalarType dtype);  // "float64", "float32", "bfloat16", "float16"
// A run's precision as results record it: the compute dtype, or "bf16-mixed" when the trainable tensors and their
// gradients are fp32 masters of a bf16 computation (--grad-dtype fp32; the name PyTorch Lightning gives it).
std::string precision_name(c10::ScalarType dtype, c10::ScalarType grad_dtype);
// Type in which norms, softmax statistics and logits are computed: at least fp32 (HF upcasts bf16 to fp32; an
// fp64 run must never be rounded down to fp32, or the fp64 oracle loses its meaning).
c10::ScalarType compute_dtype(c10::ScalarType dtype);

}  // namespace sbp
