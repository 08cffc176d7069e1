// `streambp run`: one model, one batch, one BP method; prints a summary and writes the JSON record.
#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <optional>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "experiments/cli_checks.h"
#include "baselines/methods.h"
#include "core/model/checkpoint_io.h"
#include "core/model/chunk_attention_kernels.h"
#include "core/model/gemm.h"
#include "core/io/dtype.h"
#include "core/io/safetensors.h"
#include "core/methods/memory_terms.h"
#include "core/methods/streambp.h"
#include "core/offload/offload_tier.h"
#include "experiments/commands.h"
#include "experiments/memory_check.h"
#include "experiments/memory_record.h"
#include "experiments/provenance.h"
#include "experiments/results_table.h"
#include "profiler/calibration.h"
#include "profiler/cuda_memory.h"
#include "profiler/device_timeline.h"
#include "profiler/op_profile.h"
#include "core/io/input_error.h"

namespace sbp {

// The options `run` and `train` share: model, LoRA, precision, method, objective, random batch, device, outputs.
void add_model_options(CLI::App& app, RunArgs& a) {
  add_setup_options(app, a.setup);
  add_measure_options(app, a.measure, {});  // --seq, --batch
  add_method_option(app, a.method);
  app.add_option("--ref", a.ref_dir, "reference model (HF checkpoint) for GRPO beta > 0 and DPO when the batch has no ref_logps")->check(CLI::ExistingDirectory);
  app.add_option("--pad-fraction", a.pad_fraction, "right padding of the random batch (row b: F*T*(b+1)/B pads)")->check(sbp::within(0.0, 0.99));
  app.add_option("--prompt-fraction", a.prompt_fraction, "leading label fraction set to -100 (prompt masking; with "
                 "--pack of each sequence's labels)")->check(sbp::within(0.0, 0.99));
  add_pack_option(app, a.pack);
  app.add_option("--save-adapter", a.save_adapter, "write the LoRA adapter as a PEFT folder");
  app.add_option("--save-model", a.save_model, "write the model as an HF checkpoint folder");
  app.add_option("--json", a.json, "write the run record (JSON)");
  app.add_flag("--force", a.force, "overwrite existing output files");
  add_offload_options(app, a.offload, "the peak printed is the device's, the tier's bytes beside it");
}

void add_run_options(CLI::App& app, RunArgs& a) {
  add_model_options(app, a);
  app.add_option("--batch-file", a.batch_file, "safetensors with input_ids, attention_mask and the objective's tensors "
                 "(sft: labels; grpo: completion_mask, advantages, optional old_logps, ref_logps; dpo: completion_mask, "
                 "optional ref_logps)")->check(CLI::ExistingFile);
  app.add_option("--save-grads", a.save_grads, "write every trainable parameter's gradient (safetensors; HF names, PEFT names under LoRA)");
  app.add_option("--save-batch", a.save_batch, "write the batch (safetensors)");
  app.add_option("--timeline", a.timeline, "write the memory timeline of the last step: PREFIX.csv and PREFIX.trace.json (Perfetto)");
  app.add_option("--op-profile", a.op_profile, "write the measured steps' time per outermost ATen op or autograd node "
                 "(CSV: name, calls, seconds, share of BP time) and print the largest");
  app.add_option("--profile", a.profile, "cupti (with --device cuda and --timeline PREFIX): the timeline from CUPTI's "
                 "activity records (cudaMalloc/cudaFree of the caching allocator's segments, i.e. reserved memory, "
                 "with kernels and copies in the trace) instead of the allocator's trace, plus PREFIX.cupti.csv with "
                 "every record; dropped records are counted and printed")->check(CLI::IsMember({"cupti"}));
  add_measure_options(app, a.measure, {.seq = Arity::none, .batch = Arity::none, .warmup = true, .repeats = true, .budget = true});
  app.add_flag("--model-only", a.model_only, "print the analytic memory model of this workload (and write it with "
               "--json, status model-only) without running a step; --save-model, --save-adapter and --save-batch "
               "still write the step's inputs");
  app.add_flag("--no-memory-check", a.no_memory_check, "run the step even when the model's peak is above the memory "
               "it may use (--budget-bytes, the cgroup's limit, ulimit -v, MemAvailable); without it such a step is "
               "refused before it starts: status oom, exit 3, and the longest T that fits");
}

RunParts build_run_parts(const RunArgs& a) {
  RunParts parts;
  parts.dtype = a.setup.model_dtype();
  parts.method = make_method(a.method);
  parts.objective = build_objective(a.setup);
  parts.model = build_model(a.setup);
  return parts;
}

namespace {

// A phase's modelled FLOPs (none: the method does not split its FLOPs by phase, or not this one).
std::optional<double> flops_of_phase(const std::vector<PhaseFlops>& phase_flops, const std::string& name) {
  for (const auto& p : phase_flops)
    if (p.name == name) return p.flops;
  return std::nullopt;
}

// Wall time of a phase in the measured step (the meter keys peaks by the same names).
double phase_seconds(const Measurement& m, const std::string& name) {
  for (const auto& t : m.phases)
    if (t.name == name) return t.seconds;
  return 0;
}

// One unit for a column of byte counts (its largest entry's).
template <typename Rows, typename Bytes>
ByteUnit column_unit(const Rows& rows, const Bytes& bytes_of) {
  std::int64_t largest = 0;
  for (const auto& r : rows) largest = std::max(largest, std::abs(std::int64_t(bytes_of(r))));
  return byte_unit_for(largest);
}

void print_terms(const MemoryEstimate& est) {
  std::size_t width = 0;
  for (const auto& t : est.terms) width = std::max(width, t.name.size());
  const auto unit = column_unit(est.terms, [](const MemoryTerm& t) { return t.bytes; });
  for (const auto& t : est.terms) fmt::print("            {:<{}}  {:>10}\n", t.name, width, format_bytes(t.bytes, unit));
}

// The offload tier beside the device's peak: what the tier held at its own peak against the model's host terms and,
// with --offload-host-bytes, its disk terms (the split tier counts both parts).
void print_offload(const OffloadOptions& o, const OffloadTier& tier, const MemoryEstimate& est,
                   const std::vector<MemoryTerm>& disk) {
  auto host = est.host_bytes();
  for (const auto& t : disk) host += t.bytes;
  fmt::print("offload   {} in {}: {} held at the tier's peak, {} analytic{}\n", o.describe(), tier.describe(),
             format_bytes(tier.peak_bytes()), format_bytes(host),
             tier.peak_bytes() == host ? " (exact)" : fmt::format(" ({:+d} bytes)", tier.peak_bytes() - host));
  const auto unit = column_unit(est.host, [](const MemoryTerm& t) { return t.bytes; });
  for (const auto& t : est.host) fmt::print("  host    {}  {}\n", t.name, format_bytes(t.bytes, unit));
  for (const auto& t : disk) fmt::print("  disk    {}  {}\n", t.name, format_bytes(t.bytes, unit));
}

// What the console and the record say of a step: a finished step is `unchecked`, as run compares no gradient
// (`compare` and `verify` do); otherwise the measurement's own status (oom, error).
std::string run_status(const Measurement& m) {
  return m.finished() ? check_status_name(CheckStatus::unchecked) : step_status_name(m.status);
}

// Where the model's kernel workspaces come from (the calibration's probes are listed in the JSON record).
void print_calibration(const Workload& w) {
  fmt::print("kernels   workspaces {}; {}\n", w.workspaces->source(), cpu_isa_summary());
  for (const auto& [dtype, choice] : chosen_gemm_paths())
    fmt::print("kernels   {} GEMMs {} ({})\n", dtype, choice.first, choice.second);
}

const char* chunk_attention_name(const Model& model) {
  return choose_chunk_attention(model.device().type(), model.dtype()).name();
}

void print_summary(const RunArgs& a, const Model& model, const Batch& batch, const Objective& objective,
                   const BackpropMethod& method, const ReferencePass& reference, const Measurement& m,
                   const MemoryEstimate& est, const OffloadTier* tier, const std::vector<MemoryTerm>& disk,
                   const std::vector<PhaseFlops>& phase_flops) {
  fmt::print("model     {} ({:.1f} M parameters, {})\n", a.setup.source.describe(), model.config().num_parameters() / 1e6,
             precision_name(model.dtype(), model.grad_dtype()));
  if (model.lora().enabled()) {
    std::int64_t adapter_elements = 0;
    for (const auto& t : model.adapters()) adapter_elements += t.tensor.numel();
    fmt::print("lora      {} ({:.2f} M trainable; base frozen)\n", model.lora().spec(), adapter_elements / 1e6);
  }
  fmt::print("batch     B={} T={} objective={}{}\n", batch.batch_size(), batch.seq_len(), objective.spec(),
             batch.packed ? fmt::format(", packed: {} sequences", batch.packed->sequences()) : "");
  if (reference.ran)
    fmt::print("reference {} log-probs in {:.3f} s, peak {} measured, {} analytic (at {}; before the step, not in "
               "its time or peak)\n", a.ref_dir, reference.seconds, format_bytes(reference.peak_bytes),
               format_bytes(reference.model.total_bytes()), reference.model.moment);
  fmt::print("method    {}\n", method.spec());
  if (const auto advice = streambp_chunk_advice(method, batch.seq_len()); !advice.empty())
    fmt::print("note      {}\n", advice);
  // Which kernel runs StreamBP's layer chunks on this device and dtype: a GPU owner checks it against the kernels
  // the profile shows (tests/gpu/run.sh). The other methods attend with SDPA over the whole sequence.
  if (method.spec().rfind("streambp", 0) == 0)
    fmt::print("attention {} (StreamBP's chunk attention)\n", chunk_attention_name(model));
  fmt::print("status    {}{}\n", run_status(m),
             !m.error.empty()         ? "  (" + m.error + ")"
             : m.finished()         ? "  (the step ran; run checks no gradient: `compare` or `verify` do)"
                                    : "");
  // The budget as given: the meter's limit also leaves out the bytes held before the step (its oom message says so).
  if (a.measure.budget_bytes > 0)
    fmt::print("budget    {} bytes ({}) for {}\n", a.measure.budget_bytes, format_bytes(a.measure.budget_bytes),
               model.device().is_cuda() ? "the caching allocator's reserved bytes"
                                        : "the step's peak as measured: the model's weights and the step's tensors");
  // A step that did not finish has no time, loss or peak: what it measured is a partial step.
  const bool finished = m.finished();
  if (finished) {
    fmt::print("loss      {:.10g}\n", m.loss);
    fmt::print("bp time   {:.3f} s (median of {})\n", m.median_seconds(), m.bp_seconds.size());
    const auto unit = byte_unit_for(std::max(m.peak_bytes, est.total_bytes()));
    fmt::print("peak      {} measured, {} analytic ({:+.1f}%, peak at {})\n", format_bytes(m.peak_bytes, unit),
               format_bytes(est.total_bytes(), unit), 100.0 * (double(m.peak_bytes) / double(est.total_bytes()) - 1.0),
               est.moment);
  } else {
    fmt::print("peak      {} analytic (peak at {}); no time or peak measured: the step did not finish\n",
               format_bytes(est.total_bytes()), est.moment);
  }
  print_terms(est);
  if (tier) print_offload(a.offload, *tier, est, disk);
  const auto unit = column_unit(m.phase_peaks, [](const PhasePeak& p) { return p.peak_bytes; });
  for (const auto& p : m.phase_peaks) {
    // The phase's matrix-product FLOPs over its seconds, where the method models them by phase (StreamBP).
    const auto flops = flops_of_phase(phase_flops, p.name);
    const auto seconds = phase_seconds(m, p.name);
    fmt::print("  phase   {:<12} peak {:>12}  {}  x{}{}\n", p.name, format_bytes(p.peak_bytes, unit),
               finished ? fmt::format("{:8.3f} s", seconds) : std::string("       - s"), p.count,
               finished && flops && *flops > 0 && seconds > 0 ? fmt::format("  {:6.1f} GFLOP/s", *flops / seconds / 1e9)
                                                              : "");
  }
}

// The memory check before the step (experiments/memory_check.h): the model's peak of this workload at any T
// against --budget-bytes and, on the CPU, the process's limits; the weights already allocated are part of the peak.
MemoryCheck check_step_memory(const RunArgs& a, const BackpropMethod& method, const Workload& workload,
                              const Model& model) {
  return check_workload_memory([&](const Workload& w) { return method.memory_model(w); }, workload,
                               a.measure.budget_bytes, model.device().is_cpu(), model_weight_bytes(model));
}

nlohmann::json memory_check_json(const MemoryCheck& check, bool enforced) {
  if (check.limit_bytes < 0) return nullptr;
  auto limits = nlohmann::json::array();
  for (const auto& l : check.limits) limits.push_back({{"name", l.name}, {"left_bytes", l.left_bytes}, {"detail", l.detail}});
  return {{"limit_bytes", check.limit_bytes},
          {"limits", limits},
          {"limited_by", check.limited_by},
          {"fits", check.fits()},
          {"enforced", enforced},  // false: --no-memory-check
          {"model_max_seq", check.fits() ? nlohmann::json() : nlohmann::json(check.max_seq)}};
}

// --model-only: the analytic memory model of the workload, printed and (with --json) written; no step runs.
int print_model_only(const RunArgs& a, const BackpropMethod& method, const Workload& workload, const Batch& batch,
                     const std::string& command_line) {
  const auto est = method.memory_model(workload);
  fmt::print("method    {}\nbatch     B={} T={}\nmodel     {} analytic peak (at {}; threads {}), no step run\n",
             method.spec(), batch.batch_size(), batch.seq_len(), format_bytes(est.total_bytes()), est.moment,
             workload.threads);
  print_terms(est);
  for (const auto& t : est.host) fmt::print("  host    {}  {} (the offload tier)\n", t.name, format_bytes(t.bytes));
  print_calibration(workload);
  if (!a.json.empty()) {
    const nlohmann::json j = {{"status", "model-only"},
                              {"model_peak_bytes", est.total_bytes()},
                              {"model_peak_moment", est.moment},
                              {"model_terms", terms_json(est.terms)},
                              {"model_host_bytes", est.host_bytes()},
                              {"preset", a.setup.source.describe()},
                              {"method", method.spec()},
                              {"dtype", precision_name(workload.dtype, workload.gradient_dtype())},
                              {"batch_size", batch.batch_size()},
                              {"seq_len", batch.seq_len()},
                              {"threads", workload.threads},
                              {"calibration", calibration_json(*workload.workspaces)},
                              {"provenance", to_json(collect_provenance(command_line, describe_device(a.setup.device)))}};
    write_file_atomically(a.json, j.dump(2) + "\n");
  }
  return 0;
}

// Before anything is built: what the flags cannot mean together, and the outputs, each new unless --force.
void check_run_flags(const RunArgs& a, c10::Device device) {
  if (!a.profile.empty() && (!device.is_cuda() || a.timeline.empty()))
    throw InputError("--profile cupti needs --device cuda and --timeline PREFIX (CUPTI records GPU activity)");
  if (!a.op_profile.empty() && device.is_cuda())
    throw InputError("--op-profile times ops on the host, which on CUDA is their launch, not their run; "
                                "use --profile cupti --timeline PREFIX for kernel times");
  const bool random = a.batch_file.empty();
  if (random && a.measure.seq_len() == 0) throw InputError("give --seq T (and --batch B) or --batch-file FILE");
  if (!random && a.measure.seq_len() != 0) throw InputError("--seq and --batch-file exclude each other");
  if (!random && a.pack.packed()) throw InputError("--pack makes a random batch; a --batch-file brings its own boundaries (position_ids or cu_seqlens)");
  check_distinct_outputs({{"--save-grads", a.save_grads}, {"--json", a.json}, {"--save-batch", a.save_batch},
                          {"--save-model", a.save_model}, {"--save-adapter", a.save_adapter},
                          {"--timeline", a.timeline.empty() ? "" : a.timeline + ".csv"},
                          {"--timeline", a.timeline.empty() ? "" : a.timeline + ".trace.json"},
                          {"--timeline", a.timeline.empty() || a.profile.empty() ? "" : a.timeline + ".cupti.csv"},
                          {"--op-profile", a.op_profile}});
  for (const auto& [file, flag] : {std::pair{a.save_grads, "--save-grads"}, {a.json, "--json"}, {a.save_batch, "--save-batch"}})
    if (!file.empty()) check_new_output(file, a.force, flag);
  if (!a.save_model.empty()) check_new_folder(a.save_model, a.force, "--save-model");
  if (!a.save_adapter.empty()) check_new_folder(a.save_adapter, a.force, "--save-adapter");
  if (a.model_only)
    for (const auto& [value, flag] : {std::pair{a.save_grads, "--save-grads"}, {a.timeline, "--timeline"},
                                      {a.op_profile, "--op-profile"}})
      if (!value.empty()) throw InputError(std::string(flag) + " needs a step, and --model-only runs none");
  if (!a.save_adapter.empty() && !a.setup.lora.enabled() && a.setup.adapter_dir.empty())
    throw InputError("--save-adapter needs --lora or --adapter");
}

// --timeline's and --op-profile's files, new unless --force (checked only when a step runs).
void check_profile_outputs(const RunArgs& a) {
  if (!a.timeline.empty()) {
    std::vector<std::string> outputs = {".csv", ".trace.json"};
    if (!a.profile.empty()) outputs.push_back(".cupti.csv");
    for (const auto& ext : outputs) check_new_output(a.timeline + ext, a.force, "--timeline");
  }
  if (!a.op_profile.empty()) check_new_output(a.op_profile, a.force, "--op-profile");
}

// --op-profile: every op's calls and host seconds (CSV), the top 12 printed. Shares are of the summed BP time;
// warm-up steps are profiled but not timed, so with them no share is given.
void write_op_profile(const RunArgs& a, const std::vector<OpTime>& op_times, const Measurement& m) {
  const double total = a.measure.warmup > 0 ? 0 : std::accumulate(m.bp_seconds.begin(), m.bp_seconds.end(), 0.0);
  std::ostringstream csv;
  write_op_profile_csv(op_times, total, csv);
  write_file_atomically(a.op_profile, csv.str());
  for (std::size_t i = 0; i < std::min<std::size_t>(op_times.size(), 12); ++i)
    fmt::print("op        {:<44} {:>8} calls {:>9.3f} s{}\n", op_times[i].name, op_times[i].calls, op_times[i].seconds,
               total > 0 ? fmt::format("  {:5.1f}%", 100 * op_times[i].seconds / total) : "");
}

// The step, unless the memory check refused it (then an oom measurement that says why, with no time and no peak).
Measurement measure_step(const RunArgs& a, Model& model, BackpropMethod& method, const Objective& objective,
                         const Batch& batch, const MemoryCheck& memory) {
  const bool refused = !memory.fits() && !a.no_memory_check;
  if (!memory.fits() && !refused)
    fmt::print(stderr, "note: the step runs anyway (--no-memory-check): {}\n", memory_shortfall(memory, batch.batch_size()));
  if (refused)
    return Measurement{.status = StepStatus::oom,
                       .error = "not run: " + memory_shortfall(memory, batch.batch_size()) +
                                " (--model-only shows the model's terms; --no-memory-check runs the step anyway)",
                       .weight_bytes = model_weight_bytes(model)};
  return measure_method(model, method, objective, batch, a.measure.warmup, a.measure.repeats, a.measure.budget_bytes,
                        /*report_progress=*/true);
}

// Whether CUDA is usable here (why not: `reason`), printed beside the device the run used.
bool print_device(c10::Device device, std::string& reason) {
  const bool cuda = cuda_device_available(&reason);
  fmt::print("device    {}{}\n", describe_device(device),
             device.is_cuda() ? " (peaks: caching allocator, allocated bytes)"
             : cuda           ? "; a GPU is present (--device cuda)"
                              // The runtime's full words (cudaErrorInsufficientDriver ...) go to --json only.
                              : "; CUDA memory stats and CUPTI skipped: " + reason.substr(0, reason.find(':')));
  return cuda;
}

// What a run that did not finish its step leaves unwritten, said once (a file that looks like a result would lie).
void say_skipped_outputs(const RunArgs& a, const Measurement& m) {
  std::string skipped;
  for (const auto& [value, flag] : {std::pair{a.save_grads, "--save-grads"}, {a.save_model, "--save-model"},
                                    {a.save_adapter, "--save-adapter"}, {a.save_batch, "--save-batch"}})
    if (!value.empty()) skipped += (skipped.empty() ? "" : ", ") + std::string(flag) + " " + value;
  if (!skipped.empty()) fmt::print("outputs   not written: {} (the step did not finish: {})\n", skipped,
                                step_status_name(m.status));
}

// What a run measured and everything needed to read it, for --json.
struct RunRecord {
  const RunArgs& args;
  const Model& model;
  const BackpropMethod& method;
  const Objective& objective;
  const Batch& batch;
  const ReferencePass& reference;
  const Measurement& m;
  const MemoryEstimate& est;
  const MemoryCheck& memory;
  const Workload& workload;
  const OffloadTier* tier;
  bool cuda;
  const std::string& cuda_reason;
  const Provenance& prov;
};

// --json. A status claims only what ran: a finished step is `unchecked` (run compares no gradient; `compare` does);
// an oom step has no time and no peak (what it measured is a partial step).
void write_run_record(const RunRecord& r) {
  const auto& a = r.args;
  const auto& m = r.m;
  const auto& est = r.est;
  const bool finished = m.finished();
  const auto unless_oom = [&](nlohmann::json value) { return finished ? value : nlohmann::json(); };
  nlohmann::json phases = nlohmann::json::array();
  const auto phase_flops = r.method.phase_flops(r.workload);
  for (const auto& p : m.phase_peaks) {
    const auto flops = flops_of_phase(phase_flops, p.name);
    phases.push_back({{"name", p.name}, {"peak_bytes", p.peak_bytes}, {"seconds", unless_oom(phase_seconds(m, p.name))},
                      {"count", p.count}, {"flops", flops ? nlohmann::json(*flops) : nlohmann::json()}});
  }
  nlohmann::json j = {{"status", run_status(m)},
                      {"error", m.error},
                      {"loss", unless_oom(m.loss)},
                      {"peak_bytes", unless_oom(m.peak_bytes)},
                      {"offload_tier", r.tier ? nlohmann::json(r.tier->describe()) : nlohmann::json()},
                      {"model_host_terms", terms_json(est.host)},
                      {"calibration", calibration_json(*r.workload.workspaces)},
                      {"weight_bytes", m.weight_bytes},
                      {"bp_seconds", unless_oom(m.median_seconds())},
                      {"bp_seconds_all", unless_oom(m.bp_seconds)},
                      {"phases", phases},
                      {"process_peak_rss_bytes", process_peak_rss_bytes()},
                      {"preset", a.setup.source.describe()},
                      {"method", r.method.spec()},
                      {"lora", r.model.lora().enabled() ? nlohmann::json(r.model.lora().spec()) : nlohmann::json()},
                      {"objective", r.objective.spec()},
                      {"reference_pass", r.reference.ran ? nlohmann::json{{"ref", a.ref_dir},
                                                                          {"seconds", r.reference.seconds},
                                                                          {"peak_bytes", r.reference.peak_bytes},
                                                                          {"model_peak_bytes", r.reference.model.total_bytes()}}
                                                         : nlohmann::json()},
                      {"dtype", precision_name(r.model.dtype(), r.model.grad_dtype())},
                      {"seed", a.setup.seed},
                      {"batch_size", r.batch.batch_size()},
                      {"seq_len", r.batch.seq_len()},
                      // Packed rows: how many sequences, and the --pack that drew them (empty for a batch file's).
                      {"sequences", r.batch.packed ? nlohmann::json(r.batch.packed->sequences()) : nlohmann::json()},
                      {"pack", a.pack.packed() ? nlohmann::json(a.pack.spec()) : nlohmann::json()},
                      {"budget_bytes", a.measure.budget_bytes},
                      {"memory_check", memory_check_json(r.memory, !a.no_memory_check)},
                      {"largest_allocation_bytes", unless_oom(m.largest_allocation_bytes)},
                      {"reserved_peak_bytes", m.reserved_peak_bytes >= 0 ? nlohmann::json(m.reserved_peak_bytes)
                                                                         : nlohmann::json()},
                      {"device", describe_device(a.setup.device)},
                      {"chunk_attention", chunk_attention_name(r.model)},
                      {"cuda", {{"available", r.cuda}, {"reason", r.cuda_reason}}},
                      {"provenance", to_json(r.prov)}};
  j.update(memory_record(&est, a.offload.describe(), r.tier));
  // With --offload-host-bytes the tier's peak (host_peak_bytes) holds both parts: the model's disk part beside its
  // host part.
  j["model_disk_bytes"] = r.tier && a.offload.host_bytes >= 0 ? nlohmann::json(memory::offload_disk_bytes(r.workload))
                                                               : nlohmann::json();
  write_file_atomically(a.json, j.dump(2) + "\n");
}

}  // namespace

int run_command(const RunArgs& a, const std::string& command_line) {
  a.setup.apply_threads();
  const auto device = a.setup.device;
  check_run_flags(a, device);
  const bool random = a.batch_file.empty();
  auto [dtype, model, method, objective] = build_run_parts(a);
  const auto tier = make_offload(a.offload, device, *method, /*training=*/false);  // its folder checked first
  const auto offloading = offload_backprop(a.offload, *method, tier.get());
  const auto precision = precision_name(model->dtype(), model->grad_dtype());
  const auto batch_source = random ? std::string("random batch") : a.batch_file;
  Batch batch = random ? objective->random_batch(model->config(), {a.measure.batch_size(), a.measure.seq_len(), a.pad_fraction,
                                                                   a.prompt_fraction, a.setup.seed, a.setup.group, a.pack})
                       : read_batch_file(a.batch_file);
  validate_tokens(batch, model->config(), batch_source);
  model->to(device);
  batch = batch.to(device);
  const auto reference = complete_batch(*model, *objective, batch, batch_source, random, a.ref_dir, dtype, a.setup.seed);
  // Every check before anything is written.
  auto workload = make_workload(*model, objective->prepare(batch, model->config(), std::nullopt, batch_source), batch);
  a.offload.add_to(workload);
  // The step's inputs (weights, adapter, batch): with --model-only (what a step would take, without one), or after a
  // finished step; an oom run (exit 3) writes what describes the attempt (--json, --timeline, --op-profile) and no
  // file that looks like a result.
  // `model` by an init-capture: clang refuses to capture a structured binding.
  const auto save_inputs = [&, &model = model] {
    if (!a.save_model.empty()) save_model_dir(*model, a.save_model);
    if (!a.save_adapter.empty()) save_adapter_dir(*model, a.save_adapter, a.setup.source.describe());
    if (!a.save_batch.empty()) write_batch_file(batch, a.save_batch);
  };
  if (a.model_only) {
    save_inputs();
    return print_model_only(a, *method, workload, batch, command_line);
  }

  check_profile_outputs(a);
  DeviceTimeline timeline(device, a.timeline.empty() ? TimelineSource::none
                                  : a.profile == "cupti" ? TimelineSource::cupti : TimelineSource::allocator);
  std::optional<OpProfile> op_profile;
  if (!a.op_profile.empty()) op_profile.emplace();
  if (tier) tier->reset_peak();
  const auto memory = check_step_memory(a, *method, workload, *model);
  const bool refused = !memory.fits() && !a.no_memory_check;
  const auto m = measure_step(a, *model, *method, *objective, batch, memory);
  std::vector<OpTime> op_times;
  if (op_profile) {
    op_times = op_profile->totals();
    op_profile.reset();
  }
  if (!a.timeline.empty() && !refused) timeline.stop_and_write(a.timeline);
  if (!a.op_profile.empty() && !refused) write_op_profile(a, op_times, m);
  std::string cuda_reason;
  const bool cuda = print_device(device, cuda_reason);
  const auto est = method->memory_model(workload);
  const auto phase_flops = method->phase_flops(workload);
  print_summary(a, *model, batch, *objective, *method, reference, m, est, tier.get(),
                memory::offload_disk_terms(workload), phase_flops);
  print_calibration(workload);

  const auto prov = collect_provenance(command_line, describe_device(device));
  if (m.finished())
    save_inputs();
  else
    say_skipped_outputs(a, m);
  if (!a.save_grads.empty() && m.finished()) {
    save_gradients(*model, a.save_grads,
                   {{"method", method->spec()}, {"dtype", precision}, {"commit", prov.commit}, {"command", prov.command}});
    fmt::print("gradients written to {}\n", a.save_grads);
  }
  if (!a.json.empty())
    write_run_record({a, *model, *method, *objective, batch, reference, m, est, memory, workload, tier.get(), cuda,
                      cuda_reason, prov});
  return m.finished() ? 0 : 3;
}

}  // namespace sbp
