#include "experiments/options.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <sstream>

#include <unistd.h>

#include <CLI/CLI.hpp>

#include "baselines/methods.h"
#include "core/methods/workload.h"
#include "core/offload/offload_tier.h"
#include "core/offload/split_tier.h"
#include "experiments/cli_checks.h"
#include "core/io/input_error.h"

namespace sbp {

namespace {

// A value that `parse` accepts, or the reason it gives (CLI11 prints "--flag: reason" and main exits 2).
template <typename Parse>
CLI::Validator accepted_by(Parse parse, const std::string& description) {
  return CLI::Validator(
      [parse](std::string& input) -> std::string {
        try {
          parse(input);
        } catch (const std::exception& e) {
          return e.what();
        }
        return {};
      },
      description);
}

// A spec make_method builds (the catalogue's methods and options, each value within its bounds).
CLI::Validator method_spec() {
  return accepted_by([](const std::string& spec) { make_method(spec); }, "method spec");
}

// "checkpoint,streambp:layer_chunk=64" in --methods, which separates specs with ';': that list with ';' before each
// item that names a method, or "" when no item after the first does (a comma inside one spec's options).
std::string semicolon_list(const std::string& spec) {
  const auto names = method_names();
  const auto items = split_list(spec, ',');
  std::string out;
  bool listed = false;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const bool method = std::find(names.begin(), names.end(), items[i].substr(0, items[i].find(':'))) != names.end();
    listed = listed || (i > 0 && method);
    out += (i == 0 ? "" : method ? ";" : ",") + items[i];
  }
  return listed ? out : "";
}

// As method_spec, and a list written with commas gets the list as --methods takes it.
CLI::Validator method_list_item() {
  return accepted_by(
      [](const std::string& spec) {
        try {
          make_method(spec);
        } catch (const std::invalid_argument& e) {
          if (const auto list = semicolon_list(spec); !list.empty())
            throw InputError(std::string(e.what()) + "; --methods separates specs with ';': --methods \"" +
                                        list + "\"");
          throw;
        }
      },
      "method spec");
}

// --seq or --batch as one value or a comma-separated list, each within [lo, hi].
void add_sizes(CLI::App& app, const std::string& flag, std::vector<std::int64_t>& values, Arity arity,
               std::int64_t lo, std::int64_t hi, const std::string& what) {
  if (arity == Arity::none) return;
  auto* option = app.add_option(flag, values, arity == Arity::many ? what + " (comma-separated)" : what)
                     ->check(sbp::within(lo, hi));
  if (arity == Arity::many)
    option->delimiter(',');
  else  // one value; given twice, the last one counts (as for every other flag)
    option->expected(1)->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  if (!values.empty()) option->default_str(join_values(values));
}

}  // namespace

std::string join_values(const std::vector<std::int64_t>& values) {
  std::string out;
  for (const auto v : values) out += (out.empty() ? "" : ",") + std::to_string(v);
  return out;
}

std::string join_values(const std::vector<std::string>& values, char separator) {
  std::string out;
  for (const auto& v : values) out += (out.empty() ? "" : std::string(1, separator)) + v;
  return out;
}

void add_measure_options(CLI::App& app, MeasureOptions& m, MeasureFlags flags) {
  add_sizes(app, "--seq", m.seq_lens, flags.seq, 2, std::int64_t(1) << 40, "sequence length T of a random batch");
  add_sizes(app, "--batch", m.batch_sizes, flags.batch, 1, std::int64_t(1) << 40,
            "rows B of the global batch (data-parallel: over all ranks; DPO: chosen + rejected, even)");
  if (flags.warmup)
    app.add_option("--warmup", m.warmup, "unmeasured steps before the measured ones")
        ->check(CLI::NonNegativeNumber)->capture_default_str();
  if (flags.repeats)
    app.add_option("--repeats", m.repeats, "measured steps per method and point (median time)")
        ->check(CLI::PositiveNumber)->capture_default_str();
  if (flags.check_seq)
    app.add_option("--check-seq", m.check_seq_len, "T of each method's fp64 gradient check against standard BP (0: "
                   "none)")->check(CLI::NonNegativeNumber)->capture_default_str();
  if (flags.budget) {
    auto* budget = app.add_option("--budget-bytes", m.budget_bytes, "memory budget: a step above it fails with status "
                                  "oom (CPU: live tensor bytes as the meter counts them; CUDA: the caching allocator's "
                                  "reserved bytes)");
    if (flags.budget_required)
      budget->required()->check(CLI::PositiveNumber);
    else
      budget->check(CLI::NonNegativeNumber);
  }
}

void add_method_option(CLI::App& app, std::string& spec) {
  app.add_option("--method", spec, "BP method spec: " + methods_usage())->required()->check(method_spec());
}

void add_pack_option(CLI::App& app, LengthDistribution& pack) {
  app.add_option_function<std::string>(
      "--pack", [&pack](const std::string& text) { pack = LengthDistribution::parse(text); },
      "pack each random row with several sequences, as DataCollatorWithFlattening does: position_ids restart at "
      "0 and each sequence's first label is -100 (SFT), or each sequence is one completion with its own advantage "
      "(GRPO, --group counting sequences); lengths drawn with --seed from DIST = uniform:min=A,max=B | "
      "lognormal:median=M,sigma=S | fixed:length=L, the last sequence of a row cut to fit (docs/packing.md)")
      ->type_name("DIST");
}

void add_methods_option(CLI::App& app, std::vector<std::string>& specs, const std::string& help) {
  auto* option = app.add_option("--methods", specs, help + " (semicolon-separated specs: " + methods_usage() + ")")
                     ->delimiter(';')->check(method_list_item());
  if (!specs.empty()) option->default_str(join_values(specs, ';'));
}

std::optional<OptimizerOptions> OptimizerFlags::options() const {
  // Both flags were checked while parsing; this cannot throw on what the command line gave.
  return parse_optimizer_flags(spec, state_dtype);
}

std::string OptimizerFlags::describe() const {
  const auto o = options();
  return o ? optimizer_spec(*o) + (state_dtype.empty() ? "" : ",state_dtype=" + state_dtype) : "";
}

void add_optimizer_options(CLI::App& app, OptimizerFlags& flags, const std::string& what) {
  auto* optimizer =
      app.add_option("--optimizer", flags.spec, "adamw:lr=1e-5,beta1=0.9,beta2=0.999,eps=1e-8,weight_decay=0"
                     "[,decay_norms_and_biases=0] or sgd:lr=...,momentum=0,weight_decay=0 (torch.optim's update and "
                     "defaults; weight decay on every trainable tensor unless decay_norms_and_biases=0, HF Trainer's "
                     "groups): " + what)
          ->check(accepted_by([](const std::string& spec) { parse_optimizer_spec(spec); }, "optimizer spec"));
  if (!flags.spec.empty()) optimizer->capture_default_str();
  auto* state = app.add_option("--optimizer-state-dtype", flags.state_dtype, "fp64, fp32 or bf16: the optimizer "
                               "states' dtype (default: each trainable tensor's own, as torch does)")
                    ->check(CLI::IsMember({"fp64", "fp32", "bf16"}));
  if (flags.spec.empty()) state->needs(optimizer);
}

const char* offload_kind_name(OffloadKind kind) {
  switch (kind) {
    case OffloadKind::checkpoints: return "checkpoints";
    case OffloadKind::gradients: return "grads";
    case OffloadKind::optimizer: return "optimizer";
    case OffloadKind::parameters: return "params";
  }
  return "?";
}

void add_offload_kinds_option(CLI::App& app, std::vector<OffloadKind>& kinds, const std::string& help) {
  static const std::vector<OffloadKind> all = {OffloadKind::checkpoints, OffloadKind::gradients, OffloadKind::optimizer,
                                               OffloadKind::parameters};
  std::vector<std::string> names;
  for (const auto kind : all) names.push_back(offload_kind_name(kind));
  app.add_option_function<std::vector<std::string>>(
         "--offload",
         [&kinds](const std::vector<std::string>& given) {
           kinds.clear();
           for (const auto& name : given)
             kinds.push_back(*std::find_if(all.begin(), all.end(), [&](OffloadKind k) { return name == offload_kind_name(k); }));
         },
         help)
      ->delimiter(',')->check(CLI::IsMember(names));
}

bool OffloadOptions::has(OffloadKind kind) const { return std::find(kinds.begin(), kinds.end(), kind) != kinds.end(); }

std::string OffloadOptions::describe() const {
  std::vector<std::string> names;
  for (const auto kind : kinds) names.push_back(offload_kind_name(kind));
  return join_values(names, ',');
}

void OffloadOptions::add_to(Workload& w) const {
  for (const auto kind : kinds) {
    Offload feature{kind};
    if (kind == OffloadKind::checkpoints) feature.host_bytes = host_bytes;
    w.add(feature);
  }
}

void add_offload_options(CLI::App& app, OffloadOptions& o, const std::string& what) {
  add_offload_kinds_option(app, o.kinds, "what lives in the second memory tier (comma-separated): checkpoints (the layer "
                 "inputs StreamBP, checkpointing and MsT keep: out once the forward has read them, back one layer ahead "
                 "of their backward), grads (the gradients, at their group's gradient-ready event of the step's last "
                 "micro-batch, after any data-parallel reduction), optimizer (the optimizer's states, ZeRO-Offload: "
                 "the update runs where they are), params (the trainable tensors, fetched per layer where a method "
                 "uses them and updated in the tier; on ranks ZeRO-3's slices, with --zero 3); " + what + ". A copy, never arithmetic: the run's numbers are the same bits (docs/offload.md)");
  app.add_option("--offload-dir", o.dir, "the CPU tier's folder: each offloaded tensor a memory-mapped file there, "
                 "unnamed (nothing is left behind) and reserved up front (a full disk is an error naming the folder); "
                 "default: the system's temporary folder")->check(CLI::ExistingDirectory);
  app.add_option("--offload-host-bytes", o.host_bytes,
                 "a third tier (with --offload checkpoints and --offload-dir): the layer checkpoints stored first stay "
                 "in host memory up to this many bytes (CUDA: pinned; the CPU: memory-mapped files in /dev/shm), the "
                 "rest go to memory-mapped files in --offload-dir (node-local disk), a whole layer each; the same "
                 "bits as without it (docs/offload.md)")
      ->check(CLI::NonNegativeNumber);
}

void check_offload_kinds(const OffloadOptions& o, bool training, int ranks, int zero_stage) {
  if (o.host_bytes >= 0 && (o.kinds.size() != 1 || !o.checkpoints()))
    throw InputError("--offload-host-bytes: splits the layer checkpoints between host and disk; use it with "
                     "--offload checkpoints alone (given: --offload " + o.describe() + ")");
  if (o.host_bytes >= 0 && o.dir.empty())
    throw InputError("--offload-host-bytes: name the disk tier's folder with --offload-dir (node-local disk)");
  if (o.parameters() && !training)
    throw InputError("--offload params: no optimizer step here (train, or maxlen --optimizer, update "
                                "parameters that live in the tier)");
  if (o.parameters() && ranks > 1 && zero_stage != 3)
    throw InputError("--offload params: on ranks the parameters move as ZeRO-3's slices (--zero 3), not at "
                                "ZeRO-" + std::to_string(zero_stage));
}

std::unique_ptr<OffloadTier> make_offload(const OffloadOptions& o, c10::Device device, const BackpropMethod& method,
                                          bool training, int ranks, int zero_stage) {
  if (o.kinds.empty()) return nullptr;
  check_offload_kinds(o, training, ranks, zero_stage);
  if (o.checkpoints() && !method.keeps_layer_checkpoints())
    throw InputError("--offload checkpoints: " + method.spec() + " keeps no layer checkpoints (one graph "
                                "over the whole step); offload them with checkpoint, mst or streambp");
  if (o.optimizer() && !training)
    throw InputError("--offload optimizer: no optimizer step here (train, or maxlen --optimizer, keep "
                                "optimizer states)");
  if (o.host_bytes < 0)
    return make_offload_tier(device, o.dir.empty() ? std::filesystem::temp_directory_path().string() : o.dir);
  // The host part on the CPU: memory-mapped files in RAM (/dev/shm), outside the metered pool as pinned memory is
  // outside a GPU's; where there is no /dev/shm, the system's temporary folder.
  std::error_code ec;
  const auto host_dir = std::filesystem::is_directory("/dev/shm", ec) ? std::string("/dev/shm")
                                                                      : std::filesystem::temp_directory_path().string();
  return make_split_tier(make_offload_tier(device, host_dir), make_file_tier(o.dir), o.host_bytes);
}

Subscription offload_backprop(const OffloadOptions& o, BackpropMethod& method, OffloadTier* tier) {
  if (!tier) return {};
  if (o.checkpoints()) method.offload_checkpoints_to(tier);
  if (!o.gradients()) return {};
  return method.on_gradient_ready([tier](const GradientGroup& group) { store_gradients(*tier, group.tensors); });
}

void add_output_options(CLI::App& app, OutputOptions& o, const std::string& help) {
  auto* out = app.add_option("--out", o.out_dir, help + " (relative to the current directory; the last line prints where)")
                  ->check(CLI::Validator(
                      [](std::string& folder) {
                        const auto why = unwritable_folder(folder);
                        return why.empty() ? why : folder + ": " + why;
                      },
                      "FOLDER"));
  if (!o.out_dir.empty()) out->capture_default_str();
}

std::string unwritable_folder(const std::filesystem::path& folder) {
  namespace fs = std::filesystem;
  std::error_code error;
  auto existing = fs::absolute(folder, error);
  if (error) return "cannot resolve " + folder.string() + " (" + error.message() + ")";
  while (!fs::exists(existing, error) && existing != existing.parent_path()) existing = existing.parent_path();
  if (!fs::is_directory(existing, error)) return existing.string() + " is not a folder";
  auto probe = (existing / ".streambp-probe-XXXXXX").string();
  if (!::mkdtemp(probe.data()))
    return "cannot create anything in " + existing.string() + " (" + std::strerror(errno) + ")";
  ::rmdir(probe.c_str());
  return {};
}

void check_new_folder(const std::filesystem::path& folder, bool force, const std::string& flag) {
  if (!force && std::filesystem::exists(folder))
    throw InputError(flag + " " + folder.string() + ": file exists; results are never overwritten silently "
                                "(choose another name, or pass --force)");
  if (const auto why = unwritable_folder(folder); !why.empty())
    throw InputError(flag + " " + folder.string() + ": " + why);
}

void check_new_output(const std::filesystem::path& file, bool force, const std::string& flag) {
  if (!force && std::filesystem::exists(file))
    throw InputError(flag + " " + file.string() + ": file exists; results are never overwritten silently "
                                "(choose another name, or pass --force)");
  // Before the work, not after it: an output whose folder does not exist would fail only when written.
  const auto parent = std::filesystem::absolute(file).parent_path();
  if (!std::filesystem::is_directory(parent))
    throw InputError(flag + " " + file.string() + ": the folder " + parent.string() +
                                " does not exist (create it first)");
  if (const auto why = unwritable_folder(parent); !why.empty())
    throw InputError(flag + " " + file.string() + ": " + why);
}

void check_distinct_outputs(const std::vector<OutputPath>& outputs) {
  const auto resolved = [](const std::filesystem::path& p) {
    std::error_code error;
    const auto out = std::filesystem::weakly_canonical(std::filesystem::absolute(p), error);
    return error ? std::filesystem::absolute(p).lexically_normal() : out;
  };
  for (std::size_t i = 0; i < outputs.size(); ++i)
    for (std::size_t j = i + 1; j < outputs.size(); ++j)
      if (!outputs[i].path.empty() && !outputs[j].path.empty() &&
          resolved(outputs[i].path) == resolved(outputs[j].path))
        throw InputError(outputs[i].flag + " " + outputs[i].path.string() + " and " + outputs[j].flag +
                                    " " + outputs[j].path.string() + " are one path: the second would overwrite the "
                                    "first (give them different names)");
}

std::vector<std::string> split_list(const std::string& text, char sep) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

}  // namespace sbp
