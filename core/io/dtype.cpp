#include "core/io/dtype.h"

#include <stdexcept>
#include "core/io/input_error.h"

namespace sbp {

c10::ScalarType parse_dtype(const std::string& name) {
  if (name == "fp64" || name == "float64") return c10::kDouble;
  if (name == "fp32" || name == "float32") return c10::kFloat;
  if (name == "bf16" || name == "bfloat16") return c10::kBFloat16;
  if (name == "fp16" || name == "float16") return c10::kHalf;
  throw InputError("unknown dtype '" + name + "' (fp64, fp32, bf16, fp16)");
}

std::string dtype_name(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kDouble: return "fp64";
    case c10::kFloat: return "fp32";
    case c10::kBFloat16: return "bf16";
    case c10::kHalf: return "fp16";
    default: throw InputError(std::string("unsupported model dtype ") + c10::toString(dtype));
  }
}

std::string hf_dtype_name(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kDouble: return "float64";
    case c10::kFloat: return "float32";
    case c10::kBFloat16: return "bfloat16";
    case c10::kHalf: return "float16";
    default: throw InputError(std::string("unsupported model dtype ") + c10::toString(dtype));
  }
}

std::string precision_name(c10::ScalarType dtype, c10::ScalarType grad_dtype) {
  return dtype_name(dtype) + (grad_dtype != dtype ? "-mixed" : "");
}

c10::ScalarType compute_dtype(c10::ScalarType dtype) { return dtype == c10::kDouble ? c10::kDouble : c10::kFloat; }

}  // namespace sbp
