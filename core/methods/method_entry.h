// What a BP method tells the harness about itself, in its own file: its name, its options with their defaults and
// bounds, how to build it, and what the shared tests must run of it. The catalogue (baselines/methods.h) lists one
// entry per method; make_method, the help text, the tests, the bench and the plots read every method from there.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/io/spec.h"
#include "core/methods/method.h"

namespace sbp {

// One integer option of a method's spec ("layer_chunk" in "streambp:layer_chunk=512").
struct MethodOption {
  std::string key;
  std::int64_t default_value = 1;
  std::int64_t minimum = 1;
  std::string meaning;  // for --help: "tokens per chunk inside a decoder layer"
};

// A parsed spec with the entry's options resolved: each given value checked against its minimum, each missing one
// its default. A method defined outside the library (tests' faulty twins) may read any key of spec() itself.
class MethodArgs {
 public:
  MethodArgs(const Spec& spec, const std::vector<MethodOption>& options) : spec_(spec), options_(options) {}
  std::int64_t get(const std::string& key) const;  // throws std::logic_error for a key the entry does not declare
  const Spec& spec() const { return spec_; }

 private:
  const Spec& spec_;
  const std::vector<MethodOption>& options_;
};

// What the shared test suites run of a method on a sequence of T positions.
struct MethodTestSpecs {
  // Settings at the ends of the method's options: one chunk (or none), one position per chunk, chunks that do not
  // divide T. The exactness, objective and low-precision tests run every one against standard BP. Empty for
  // standard BP, the reference itself.
  std::function<std::vector<std::string>(std::int64_t T)> edges;
  // One setting with several chunks, the last one short: what the meter, FLOP, training and distributed tests
  // measure.
  std::function<std::string(std::int64_t T)> typical;
  // The settings the memory-model tests hold within 3% of the meter, on tiny shapes at T = 512 to 2048: the
  // defaults, and for a chunked method one with many chunks. Empty: the method's defaults alone.
  std::vector<std::string> metered;
};

struct MethodEntry {
  std::string name;
  std::string summary;  // one line for --help
  std::vector<MethodOption> options;
  std::function<std::unique_ptr<BackpropMethod>(const MethodArgs& args)> make;
  MethodTestSpecs tests;
  // Registered from a factory of the spec alone (register_method(name, factory)): make_method leaves the keys to it.
  bool reads_spec_itself = false;
  // "mst:mini_seq=N" with each option's default: "mst[:mini_seq=64]".
  std::string usage() const;
};

}  // namespace sbp
