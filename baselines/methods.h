// Builds any BP method from its spec string: "standard", "checkpoint", "streambp:layer_chunk=C,head_chunk=H".
#pragma once

#include <memory>
#include <string>
#include <vector>
#include <functional>

#include "core/io/spec.h"

#include "core/methods/method.h"

namespace sbp {

std::unique_ptr<BackpropMethod> make_method(const std::string& spec);  // throws std::invalid_argument
std::vector<std::string> method_names();

// A method defined outside this library (a user's new method; the tests' faulty ones, so that a command such as
// `verify --gate` can be shown to fail): make_method builds `name` with `factory` from then on. Throws when `name`
// is a built-in method's.
using MethodFactory = std::function<std::unique_ptr<BackpropMethod>(const Spec& spec)>;
void register_method(const std::string& name, MethodFactory factory);

}  // namespace sbp
