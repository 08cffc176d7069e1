// Builds any BP method from its spec string: "standard", "checkpoint", "streambp:layer_chunk=C,head_chunk=H".
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/methods/method.h"

namespace sbp {

std::unique_ptr<BackpropMethod> make_method(const std::string& spec);  // throws std::invalid_argument
std::vector<std::string> method_names();

}  // namespace sbp
