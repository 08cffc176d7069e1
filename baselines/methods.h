// The catalogue of BP methods: every built-in method's entry (core/methods/method_entry.h, defined in the method's
// own file) in one list, and the methods registered at run time. make_method, the help text, the tests, the bench and
// the plots read the methods from here and nowhere else. It sits at the top of the method layer, above StreamBP
// (core/methods) and the baselines, because it names them all.
//
// Adding a method: its class and its entry function in its own files (see the existing four), one line in the list
// in methods.cpp, and its files in the library's CMakeLists.txt.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/io/spec.h"
#include "core/methods/method.h"
#include "core/methods/method_entry.h"
#include "core/io/input_error.h"

namespace sbp {

// Built from a spec ("standard", "mst:mini_seq=8", "streambp:layer_chunk=512,head_chunk=128"): throws
// InputError naming the method and the option for an unknown method, an unknown key or a value below its
// minimum.
std::unique_ptr<BackpropMethod> make_method(const std::string& spec);
// Every entry, the built-in ones first (in the order of the list), then the registered ones.
std::vector<MethodEntry> method_entries();
// The built-in entries alone: what the shared test suites iterate (a test's registered fault is not a method).
const std::vector<MethodEntry>& builtin_method_entries();
std::vector<std::string> method_names();
// The usage of every method for --help: "standard | checkpoint | mst[:mini_seq=64] | streambp[:...]".
std::string methods_usage();

// A method defined outside this library (a user's new method; the tests' faulty twins, so that a command such as
// `verify --gate` can be shown to fail): make_method builds it from then on (a second registration of a name
// replaces the first). Throws when the name is a built-in method's.
void register_method(MethodEntry entry);
// The same for a method read from its spec alone (no declared options: the factory checks its keys itself).
using MethodFactory = std::function<std::unique_ptr<BackpropMethod>(const Spec& spec)>;
void register_method(const std::string& name, MethodFactory factory);

// What the shared test suites run on a sequence of T positions, over every method of the catalogue: each method's
// edge settings (standard BP, the reference, has none), and each method's typical setting (standard first).
std::vector<std::string> edge_method_specs(std::int64_t T);
std::vector<std::string> typical_method_specs(std::int64_t T);
// What the memory-model tests measure, over every method of the catalogue: each method's metered settings.
std::vector<std::string> metered_method_specs();

}  // namespace sbp
