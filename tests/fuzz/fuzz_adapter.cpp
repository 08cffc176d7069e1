// libFuzzer target: a PEFT adapter folder, adapter_config.json (the input's first part) and, when there is a second
// part, adapter_model.safetensors, loaded onto a fresh micro model (fuzz_support.h) by load_adapter_dir. Refusals
// must name a file of the folder or the folder, which all start with the folder's path. An adapter that loads must
// hold exactly the tensors its config asks for (the model's adapters are those, in the config's rank).
#include <ATen/ATen.h>

#include "core/model/checkpoint_io.h"
#include "core/model/lora.h"
#include "core/model/model.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace sbp::fuzz;
  const auto parts = split_parts(data, size);
  const auto dir = put_folder("adapter", parts, {"adapter_config.json", "adapter_model.safetensors"});
  const auto config_file = dir / "adapter_config.json";

  sbp::LoraConfig lora;
  if (!refuses_cleanly("read_adapter_config", config_file.string(), [&] { lora = sbp::read_adapter_config(config_file); }))
    return 0;
  sbp::Model model(micro_config(), at::kFloat, 0);
  if (!refuses_cleanly("load_adapter_dir", dir.string(), [&] { sbp::load_adapter_dir(model, dir, {}); })) return 0;
  const auto expected = sbp::lora_parameter_count(model.config(), lora);
  std::int64_t loaded = 0;
  for (const auto& a : model.adapters()) loaded += a.tensor.numel();
  if (model.lora().rank != lora.rank || loaded != expected)
    finding("a loaded adapter holds " + std::to_string(loaded) + " elements, its config asks for " +
            std::to_string(expected));
  return 0;
}
