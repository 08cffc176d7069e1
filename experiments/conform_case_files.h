// A conform case's files (docs/conformance.md): writing them, the harness's fp64 oracle on them, and reading back
// what the implementation returned (grads.safetensors, result.json) with the first reason it cannot be judged.
#pragma once

#include <cstddef>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>

#include <c10/core/ScalarType.h>

#include "core/io/safetensors.h"
#include "verify/conformance.h"

namespace sbp {

struct ChildRun;
class Model;
class Objective;
struct Batch;

// What an implementation returned: gradients and loss, or the first reason they cannot be judged.
struct Returned {
  TensorList grads;
  std::optional<double> loss;
  std::string problem;
};

// `dtype`: the case's, every returned tensor's; `micro_batches`: the case's count (0: one pass), which result.json must
// report; `with_loss`: result.json's loss is read (an rl_step case's is not judged: trainers report their step's loss
// in scalings of their own).
Returned read_returned(const std::filesystem::path& dir, const ChildRun& run, c10::ScalarType dtype,
                       std::size_t micro_batches = 0, bool with_loss = true);

// The case's files, as the protocol has them.
void write_case(const ConformCase& c, const std::filesystem::path& dir, const Model& model, const Objective& objective,
                const Batch& batch);

// The harness's fp64 standard BP on the case's files (the weights as rounded to the case dtype, read back in fp64).
// A micro-batch case under union accumulation is the whole batch at once (the union, by its own totals); under
// micro-means each micro-batch by its own totals, the gradients and losses averaged.
std::pair<TensorList, double> oracle(const ConformCase& c, const std::filesystem::path& dir, const Batch& batch,
                                     Accumulation accumulation);

// The case's inputs (model, adapter, batch, case.json) copied to another folder (the baseline's run of it).
void copy_case(const std::filesystem::path& from, const std::filesystem::path& to);

}  // namespace sbp
