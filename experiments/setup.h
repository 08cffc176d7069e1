// What a command runs on: the model (its source, precision and LoRA), the objective, the device, the threads and the
// seed. One typed struct that every command building a model fills from its flags through add_setup_options and turns
// into a model and an objective through the functions below, so a flag is defined once and means the same in
// `run`, `train`, `sweep`, `demo`, `maxlen`, `profile` and `verify`.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include "core/io/input_error.h"
#include "core/model/lora.h"

namespace CLI {
class App;
}

namespace sbp {

class Model;
class Objective;

struct ModelSource {
  std::string preset;        // --preset NAME
  std::string config_file;   // --config config.json (random weights)
  std::string load_dir;      // --load DIR (HF checkpoint)
  std::string describe() const;  // what goes into the results' "preset" column
  // This source, or the named preset when no model was given (no --preset, --config or --load).
  ModelSource or_preset(const std::string& name) const;
};

struct Setup {
  ModelSource source;
  std::optional<c10::ScalarType> dtype;       // --dtype; none: the --load checkpoint's torch_dtype, else fp32
  std::optional<c10::ScalarType> grad_dtype;  // --grad-dtype fp32 with --dtype bf16: mixed precision; none: the dtype
  LoraConfig lora;          // --lora (core/model/lora.h); rank 0: none
  std::string lora_spec;    // --lora as given, for the resume fingerprint (whose bytes runs already written carry)
  std::string adapter_dir;  // a PEFT adapter folder to load
  // --objective, built from the catalogue once CLI11 has accepted the command line (a bad spec exits 2 naming it);
  // an objective is immutable, so every step and rank shares this one. Null until then: build_objective gives SFT.
  std::shared_ptr<const Objective> objective;
  std::int64_t group = 0;   // GRPO random batches: completions per prompt (0: the whole batch)
  c10::Device device = c10::Device(c10::kCPU);  // --device (experiments/device.h)
  int threads = 0;          // intra-op threads; 0: torch's default
  std::uint64_t seed = 0;   // random weights, adapters and batches

  c10::ScalarType model_dtype() const;
  // Sets the intra-op threads when asked for; every command calls it first.
  void apply_threads() const;
};

// Which of Setup's flags a command offers; the ones it does not keep the command's own value.
struct SetupFlags {
  bool load = true, dtype = true, grad_dtype = true, lora = true, adapter = true, group = true, device = true,
       seed = true;
  // The model when no --preset/--config/--load is given (set once parsing is complete, and shown by --help);
  // nullptr: one of them is required.
  const char* default_preset = nullptr;
};
// --lora and --device are parsed once CLI11 has accepted the whole command line (its own rejections come first):
// app.parse throws InputError naming the flag, which main turns into exit 2.
void add_setup_options(CLI::App& app, Setup& setup, SetupFlags flags = {});

// The model of one source in `dtype` (a preset or config.json with random weights from `seed`, or an HF checkpoint):
// Throws InputError unless exactly one of --preset, --config, --load is given.
std::unique_ptr<Model> build_model(const ModelSource& source, c10::ScalarType dtype, std::uint64_t seed);
// --lora and/or --adapter DIR on a freshly built model (nothing without either).
void apply_lora(Model& model, const LoraConfig& lora, const std::string& adapter_dir, std::uint64_t seed);

// The model the setup describes, on the CPU: source in model_dtype(), --lora/--adapter, then --grad-dtype.
std::unique_ptr<Model> build_model(const Setup& setup);
std::shared_ptr<const Objective> build_objective(const Setup& setup);

}  // namespace sbp
