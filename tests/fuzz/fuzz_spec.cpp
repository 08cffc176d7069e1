// libFuzzer target: the text a user types after --method, --objective, --lora, --optimizer, --lr-schedule, --dtype
// and --device, through every parser of such text. A refusal must be a std::invalid_argument with a sentence (the
// CLI prints it and exits 2), not a bare "stoll" from the standard library or an exception of another kind. A spec
// that parses must come back from its canonical form: parse(canonical(parse(text))) has the same canonical form.
#include <ATen/ATen.h>

#include "baselines/methods.h"
#include "core/io/dtype.h"
#include "core/model/lora.h"
#include "core/objectives/objective.h"
#include "core/training/lr_schedule.h"
#include "core/training/optimizer.h"
#include "experiments/device.h"
#include "tests/fuzz/fuzz_support.h"

namespace {

using sbp::fuzz::finding;

// Runs `body`; true when it finished, false when it refused as the CLI expects; a finding otherwise.
template <class F>
bool parses(const std::string& parser, const std::string& text, F&& body) {
  try {
    body();
    return true;
  } catch (const std::invalid_argument& e) {
    const std::string message = e.what();
    if (message.find(' ') == std::string::npos)
      finding(parser + " refused '" + text + "' with a bare '" + message + "' that says nothing to a user");
    return false;
  } catch (const std::exception& e) {
    finding(parser + " threw a " + typeid(e).name() + " on '" + text + "': " + e.what());
  } catch (...) {
    finding(parser + " threw something that is not a std::exception on '" + text + "'");
  }
}

template <class Parse, class Canonical>
void round_trip(const std::string& parser, const std::string& text, Parse&& parse, Canonical&& canonical) {
  std::string first;
  if (!parses(parser, text, [&] { first = canonical(parse(text)); })) return;
  std::string second;
  if (!parses(parser, first, [&] { second = canonical(parse(first)); }))
    finding(parser + " refuses its own canonical form '" + first + "' of '" + text + "'");
  if (second != first) finding(parser + ": '" + text + "' -> '" + first + "' -> '" + second + "'");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  round_trip("make_method", text, sbp::make_method, [](const auto& m) { return m->spec(); });
  round_trip("make_objective", text, sbp::make_objective, [](const auto& o) { return o->spec(); });
  round_trip("parse_optimizer_spec", text, sbp::parse_optimizer_spec, sbp::optimizer_spec);
  round_trip("parse_lr_schedule", text, sbp::parse_lr_schedule, sbp::lr_schedule_spec);
  round_trip("parse_lora_spec", text, sbp::parse_lora_spec, [](const sbp::LoraConfig& c) { return c.spec(); });
  parses("parse_optimizer_flags", text, [&] { (void)sbp::parse_optimizer_flags(text, "fp32"); });
  parses("parse_state_dtype", text, [&] { (void)sbp::parse_state_dtype(text); });
  parses("parse_dtype", text, [&] { (void)sbp::parse_dtype(text); });
  parses("parse_device", text, [&] { (void)sbp::parse_device(text); });
  return 0;
}
