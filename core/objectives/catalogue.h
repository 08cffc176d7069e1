// The catalogue of objectives: one entry per objective (its name, how to build it from a spec, the specs the shared
// tests run it at). make_objective, --help and the tests read the objectives from here, as the methods' catalogue
// (baselines/methods.h) serves the methods.
//
// Adding an objective: its class in its own files (see sft, grpo, dpo), one entry in catalogue.cpp, its files in the
// library's CMakeLists.txt.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/io/spec.h"
#include "core/objectives/objective.h"

namespace sbp {

struct ObjectiveEntry {
  std::string name;
  // Builds it from a parsed spec (its keys checked by the objective, which knows its options and their bounds).
  std::function<std::unique_ptr<Objective>(const Spec& spec)> make;
  // What the shared test suites run of it: one spec per code path of its options (the row term, label smoothing,
  // sequence importance), the first its typical setting.
  std::vector<std::string> test_specs;
  // "grpo:beta=0,...": the spec with every option at its default (the objective's own spec()), for --help.
  std::string usage() const;
};

const std::vector<ObjectiveEntry>& objective_catalogue();
std::vector<std::string> objective_names();
// "sft | grpo:beta=0,... | dpo:beta=0.1,label_smoothing=0" for --help.
std::string objectives_usage();
// Each objective's typical test spec, in catalogue order: what a test that runs every objective once iterates.
std::vector<std::string> typical_objective_specs();

}  // namespace sbp
