// --device cpu|cuda[:N]: which device a run's model, batch and step live on. The CPU is the default and the only
// device these machines have; a CUDA device that is not there is a usage error (exit 2), never a silent CPU run.
#pragma once

#include <string>

#include <c10/core/Device.h>
#include "core/io/input_error.h"

namespace CLI {
class App;
}

namespace sbp {

// "cpu", "cuda" (device 0) or "cuda:N". Throws InputError naming the flag for anything else, and for a
// CUDA device this process cannot use (no driver, no GPU, or N out of range), with the CUDA runtime's reason.
c10::Device parse_device(const std::string& text);

// Adds --device to a command (the value is checked when the command runs: parse_device).
void add_device_option(CLI::App& app, std::string& device);

// What the results' "machine" column adds for a GPU run: "cpu" or "cuda:N (<GPU name>)".
std::string describe_device(const c10::Device& device);

}  // namespace sbp
