// libFuzzer target: an HF checkpoint folder, config.json (the input's first part) and, when there is a second part,
// model.safetensors. The config goes through read_config_json and read_config_dtype; one that reads must survive
// config_to_json and a second read unchanged. With weights, load_model_dir builds the model, checking every tensor
// against the config -- for configs of at most kMaxParameters parameters, which keeps an input's cost at the
// reader's, not at allocating whatever model a garbage config describes (the names and shapes are checked before
// anything is allocated for them).
#include "core/model/checkpoint_io.h"
#include "core/model/config.h"
#include "core/model/model.h"
#include "tests/fuzz/fuzz_support.h"

namespace {
constexpr std::int64_t kMaxParameters = 1 << 20;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace sbp::fuzz;
  const auto parts = split_parts(data, size);
  const auto dir = put_folder("checkpoint", parts, {"config.json", "model.safetensors"});
  const auto config_file = dir / "config.json";

  refuses_cleanly("read_config_dtype", config_file.string(), [&] { (void)sbp::read_config_dtype(config_file); });
  sbp::ModelConfig config;
  if (!refuses_cleanly("read_config_json", config_file.string(), [&] { config = sbp::read_config_json(config_file); }))
    return 0;
  const std::string text = sbp::config_to_json(config, "float32");
  const auto rewritten = put("rewritten.json", text);
  if (sbp::config_to_json(sbp::read_config_json(rewritten), "float32") != text)
    finding("config_to_json and read_config_json do not round-trip:\n" + text);

  if (parts.size() > 1 && config.num_parameters() <= kMaxParameters)
    refuses_cleanly("load_model_dir", dir.string(), [&] { (void)sbp::load_model_dir(dir, at::kFloat); });
  return 0;
}
