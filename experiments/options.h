// The typed option groups beside Setup (setup.h): what a command measures, which BP methods it runs, its optimizer and
// its outputs (the ranks' group is ranks.h). Each group is one struct filled by one add_*_options function, so a flag
// is declared once, means the same in every command, and arrives parsed: CLI11 splits lists into integer vectors and
// method specs, and checks each value (a method spec against the catalogue) while parsing, so a bad value is a usage
// error (exit 2) naming the flag before any work starts.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/Device.h>

#include "core/methods/event_hooks.h"
#include "core/objectives/length_distribution.h"
#include "core/training/optimizer.h"
#include "core/io/input_error.h"
#include "core/offload/offload_kind.h"

namespace CLI {
class App;
}

namespace sbp {

class BackpropMethod;
class OffloadTier;
struct Workload;

// How many values a list flag takes in a command: none (not offered), one, or a comma-separated list.
enum class Arity { none, one, many };

// The points a command measures and how.
struct MeasureOptions {
  std::vector<std::int64_t> seq_lens;     // --seq: T of a random batch (one, or "1024,2048")
  std::vector<std::int64_t> batch_sizes;  // --batch: B, rows of the global batch (one, or "1,2,4")
  int warmup = 0;                         // --warmup: unmeasured steps first
  int repeats = 1;                        // --repeats: measured steps (median time)
  std::int64_t check_seq_len = 0;         // --check-seq: T of the fp64 gradient check (0: none)
  std::int64_t budget_bytes = 0;          // --budget-bytes: a step above it is `oom` (0: none)

  // The one value of a single-point command (--seq; 0 when not given: a batch file decides).
  std::int64_t seq_len() const { return seq_lens.empty() ? 0 : seq_lens.front(); }
  std::int64_t batch_size() const { return batch_sizes.empty() ? 1 : batch_sizes.front(); }
};

// Which of the group's flags a command offers. The defaults are the struct's values when the command adds the group.
struct MeasureFlags {
  Arity seq = Arity::one, batch = Arity::one;
  bool warmup = false, repeats = false, check_seq = false, budget = false, budget_required = false;
};
void add_measure_options(CLI::App& app, MeasureOptions& options, MeasureFlags flags);

// --method SPEC (required) and --methods "standard;streambp:layer_chunk=512": each spec is checked by make_method
// while parsing (an unknown method, option or value is exit 2 naming it) and kept as the user wrote it (commands
// print method->spec(), the canonical form). A --methods default is the vector's value when the command adds it.
void add_method_option(CLI::App& app, std::string& spec);
// --pack DIST: random rows packed with several sequences of DIST's lengths (docs/packing.md), parsed into `pack`.
void add_pack_option(CLI::App& app, LengthDistribution& pack);
void add_methods_option(CLI::App& app, std::vector<std::string>& specs, const std::string& help);

// --optimizer SPEC and --optimizer-state-dtype D, each checked while parsing (the spec by parse_optimizer_spec; D
// needs an optimizer). Empty spec: no optimizer (forward + backward only), unless the command sets a default.
struct OptimizerFlags {
  std::string spec, state_dtype;  // as given, for records and fingerprints
  // What they ask for: nothing without a spec.
  std::optional<OptimizerOptions> options() const;
  // The results' optimizer column: the canonical spec, with ",state_dtype=D" when given; "" without one.
  std::string describe() const;
};
// The flags' help texts say what the optimizer does in this command (`what`); a command with a default spec (train's
// "adamw") initialises flags.spec before the call.
void add_optimizer_options(CLI::App& app, OptimizerFlags& flags, const std::string& what);

// Where a command's results go.
struct OutputOptions {
  std::string out_dir;  // --out: the results folder (CSV + JSON sidecars)
};
void add_output_options(CLI::App& app, OutputOptions& options, const std::string& help);

const char* offload_kind_name(OffloadKind kind);  // as --offload spells it: checkpoints, grads, optimizer, params
// --offload's list, parsed once: comma-separated kind names, a name that is none of them a usage error (exit 2).
void add_offload_kinds_option(CLI::App& app, std::vector<OffloadKind>& kinds, const std::string& help);

// --offload KINDS and --offload-dir DIR: what moves to the second memory tier and, on the CPU, the folder of its
// memory-mapped files.
struct OffloadOptions {
  std::vector<OffloadKind> kinds;  // in the order given (the results' offload column keeps it)
  std::string dir;                 // empty: the system's temporary folder
  // --offload-host-bytes: the checkpoints stored first stay in host memory up to this many bytes, the rest go to
  // memory-mapped files in `dir` (node-local disk), whole layers each (the third tier, issue #61); -1: no split.
  std::int64_t host_bytes = -1;
  bool has(OffloadKind kind) const;
  bool checkpoints() const { return has(OffloadKind::checkpoints); }
  bool optimizer() const { return has(OffloadKind::optimizer); }
  bool gradients() const { return has(OffloadKind::gradients); }
  bool parameters() const { return has(OffloadKind::parameters); }
  std::string describe() const;  // "checkpoints,optimizer", "" without offload: the results' offload column
  void add_to(Workload& w) const;  // each kind as the memory models' Offload feature (checkpoints with host_bytes)
};
// `what` says what the command does with it (for --offload's help).
void add_offload_options(CLI::App& app, OffloadOptions& options, const std::string& what);
// The tier these options ask for on `device`, for `method` and, when `training`, its optimizer; made before any work
// (nothing without --offload). Throws InputError (exit 2) naming the flag for checkpoints with a method
// that keeps none, optimizer states without an optimizer, parameters without training steps or on ranks below ZeRO-3
// (`ranks`, `zero_stage`: --nproc and --zero), or a folder that is not writable or has no room.
std::unique_ptr<OffloadTier> make_offload(const OffloadOptions& options, c10::Device device,
                                          const BackpropMethod& method, bool training, int ranks = 1,
                                          int zero_stage = 0);
// The part of make_offload's checks that needs no method or folder: a launcher runs it before any rank starts.
void check_offload_kinds(const OffloadOptions& options, bool training, int ranks, int zero_stage);
// A forward + backward without a Trainer (run, maxlen without --optimizer): what these options move, the method's
// layer checkpoints and its gradients at their events, into `tier` (nothing when it is null). A Trainer takes the
// gradients itself (TrainOptions::gradient_tier), after the data-parallel reduction. The gradients move while the
// returned subscription lives.
[[nodiscard]] Subscription offload_backprop(const OffloadOptions& options, BackpropMethod& method, OffloadTier* tier);

// What every command checks of an output before its work starts.
// Refuses to overwrite an existing result unless `force` (results are never overwritten silently), and a file whose
// folder does not exist or cannot be written into (found before the work, not when writing after it).
void check_new_output(const std::filesystem::path& file, bool force, const std::string& flag);
// The same for an output folder (--save-model, --save-adapter), which is created with its parents when written.
void check_new_folder(const std::filesystem::path& folder, bool force, const std::string& flag);
// Why `folder` cannot be created, or written into when it exists ("" when it can): checked by making and removing
// a directory in the nearest folder that exists, since permissions say nothing for root (/proc refuses anyway).
std::string unwritable_folder(const std::filesystem::path& folder);

// One file or folder a command will write, and the flag that names it (a derived file names its flag's, as
// "--metrics (its .json sidecar)").
struct OutputPath {
  std::string flag;
  std::filesystem::path path;
};
// Before any work: two outputs on one path (after resolving `.`, `..` and symbolic links) would overwrite each other,
// so they are refused naming both flags. Every command that writes several outputs passes all of them at once.
void check_distinct_outputs(const std::vector<OutputPath>& outputs);

// "a;b;;c" -> {a, b, c}: a flag's list (empty items dropped).
std::vector<std::string> split_list(const std::string& text, char sep);
// A list flag's default as the user would type it: {1024, 2048} -> "1024,2048".
std::string join_values(const std::vector<std::int64_t>& values);
std::string join_values(const std::vector<std::string>& values, char separator);

}  // namespace sbp
