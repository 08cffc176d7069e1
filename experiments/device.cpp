#include "experiments/device.h"

#include <charconv>
#include <stdexcept>

#include <CLI/CLI.hpp>

#include "profiler/cuda_memory.h"
#include "core/io/input_error.h"

namespace sbp {

c10::Device parse_device(const std::string& text) {
  const std::string usage = "--device " + text + ": expected cpu, cuda or cuda:N";
  if (text == "cpu") return c10::Device(c10::kCPU);
  if (text.rfind("cuda", 0) != 0) throw InputError(usage);
  int index = 0;
  if (text.size() > 4) {
    const char* first = text.data() + 5;
    const char* last = text.data() + text.size();
    const auto [end, error] = std::from_chars(first, last, index);
    if (text[4] != ':' || first == last || error != std::errc() || end != last || index < 0)
      throw InputError(usage);
  }
  std::string reason;
  if (!cuda_device_available(&reason)) throw InputError("--device " + text + ": " + reason);
  if (index >= cuda_device_count())
    throw InputError("--device " + text + ": this machine has " + std::to_string(cuda_device_count()) +
                                " CUDA device(s)");
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
}

void add_device_option(CLI::App& app, std::string& device) {
  app.add_option("--device", device,
                 "cpu (default), cuda or cuda:N; every method runs on it (the fp64 gradient checks stay on the CPU)");
}

std::string describe_device(const c10::Device& device) {
  if (!device.is_cuda()) return "cpu";
  return "cuda:" + std::to_string(device.index()) + " (" + cuda_device_name(device.index()) + ")";
}

}  // namespace sbp
