// libFuzzer target: a sharded HF checkpoint folder through read_safetensors_dir. The input's first part is
// model.safetensors.index.json, the others its shards model-0000k-of-0000n.safetensors (fuzz_support.h's separator).
// Refusals must name a file of the folder or the folder itself, which both start with the folder's path.
#include <fmt/format.h>

#include "core/io/safetensors.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace sbp::fuzz;
  const auto parts = split_parts(data, size);
  std::vector<std::string> names = {"model.safetensors.index.json"};
  for (std::size_t k = 1; k < parts.size(); ++k)
    names.push_back(fmt::format("model-{:05d}-of-{:05d}.safetensors", k, parts.size() - 1));
  const auto dir = put_folder("checkpoint", parts, names);
  refuses_cleanly("read_safetensors_dir", dir.string(), [&] { (void)sbp::read_safetensors_dir(dir); });
  return 0;
}
