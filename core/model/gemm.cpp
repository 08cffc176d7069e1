#include "core/model/gemm.h"
#include "core/model/gemm_store.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <optional>
#include <stdexcept>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/custom_function.h>
#include "core/io/input_error.h"

namespace sbp {

namespace {

bool is_narrow(c10::ScalarType dtype) { return dtype == at::kBFloat16 || dtype == at::kHalf; }

const char* name(GemmPath p) { return p == GemmPath::native ? "native" : "widened"; }

GemmPath parse_path(const std::string& text, const std::string& source) {
  if (text == "native") return GemmPath::native;
  if (text == "widened") return GemmPath::widened;
  throw InputError(source + ": GEMM path '" + text + "' (expected native or widened)");
}

struct Choice {
  GemmPaths paths;
  std::string reason;
};

// The CPU's flags as the kernel lists them ("... avx512_bf16 amx_bf16 amx_tile ..."); empty where unreadable.
std::string cpu_flags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("flags", 0) == 0) return line.substr(line.find(':') + 1) + " ";
  return "";
}

bool has_flag(const std::string& flags, const std::string& flag) { return flags.find(" " + flag + " ") != std::string::npos; }

}  // namespace

namespace {

// oneDNN's names of the levels below AVX512-BF16 (its kernels there emulate bf16); any other value (ALL, DEFAULT,
// *BF16*, *AMX*, or one oneDNN ignores) leaves the CPU's own bf16 instructions on.
std::string upper(const std::string& text) {
  std::string out;
  for (const char ch : text) out += static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  return out;
}

bool cap_below_bf16(const std::string& onednn_max_isa) {
  const auto cap = upper(onednn_max_isa);
  for (const char* below : {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"})
    if (cap == below) return true;
  return false;
}

bool cap_below_amx(const std::string& onednn_max_isa) {
  const auto cap = upper(onednn_max_isa);
  return cap_below_bf16(onednn_max_isa) || cap == "AVX512_CORE_BF16" || cap == "AVX512_CORE_FP16" ||
         cap == "AVX10_1_512" || cap == "AVX10_2_512";
}

}  // namespace

std::pair<GemmPath, std::string> default_narrow_gemm_path(const std::string& flags, const std::string& onednn_max_isa) {
  const auto padded = " " + flags + " ";
  const bool bf16_instructions = has_flag(padded, "avx512_bf16") || has_flag(padded, "amx_bf16");
  if (bf16_instructions && cap_below_bf16(onednn_max_isa))
    return {GemmPath::widened, "ONEDNN_MAX_CPU_ISA=" + onednn_max_isa +
                                   " keeps oneDNN off the CPU's bf16 instructions: native bf16 GEMMs are emulated"};
  if (!(has_flag(padded, "amx_bf16") && has_flag(padded, "amx_tile")))
    return {GemmPath::widened, has_flag(padded, "avx512_bf16")
                                   ? "AVX512-BF16 without AMX and no measurement of this machine: widened"
                                   : "the CPU has no bf16 instructions: native bf16 GEMMs are emulated"};
  if (cap_below_amx(onednn_max_isa))
    return {GemmPath::widened, "ONEDNN_MAX_CPU_ISA=" + onednn_max_isa + " keeps oneDNN off the AMX tile units"};
  return {GemmPath::native, "AMX-BF16: oneDNN's bf16 GEMMs run on the tile units"};
}

bool native_narrow_kernels(const std::string& flags, const std::string& onednn_max_isa, c10::ScalarType dtype) {
  const auto padded = " " + flags + " ";
  if (dtype == at::kHalf)
    return (has_flag(padded, "avx512_fp16") || has_flag(padded, "amx_fp16")) && !cap_below_bf16(onednn_max_isa) &&
           upper(onednn_max_isa) != "AVX512_CORE_BF16";
  return (has_flag(padded, "avx512_bf16") || has_flag(padded, "amx_bf16")) && !cap_below_bf16(onednn_max_isa);
}

namespace {

std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// STREAMBP_GEMM_PROBE=off: this process never times the paths (tests, CI); any other value or none allows it.
bool gemm_probe_allowed() { return env_or_empty("STREAMBP_GEMM_PROBE") != "off"; }

// The oneDNN cap this process runs under ("" when none).
std::string onednn_cap_env() {
  const auto cap = env_or_empty("ONEDNN_MAX_CPU_ISA");
  return cap.empty() ? env_or_empty("DNNL_MAX_CPU_ISA") : cap;  // oneDNN's older name of the same knob
}

}  // namespace

std::string onednn_cap_for(const std::string& flags, const std::string& aten_capability,
                           const std::string& onednn_max_isa) {
  const auto padded = " " + flags + " ";
  if (!has_flag(padded, "amx_tile") || !onednn_max_isa.empty()) return "";
  std::string cap;
  for (const char ch : aten_capability) cap += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return cap == "default" || cap == "avx2" ? "AVX512_CORE_BF16" : "";
}

std::string coherent_cpu_configuration() {
  const auto aten = env_or_empty("ATEN_CPU_CAPABILITY");
  const auto cap = onednn_cap_for(cpu_flags(), aten, onednn_cap_env());
  if (cap.empty()) return "";
  setenv("ONEDNN_MAX_CPU_ISA", cap.c_str(), 1);
  return "note: ATEN_CPU_CAPABILITY=" + aten + " on a CPU with AMX: ONEDNN_MAX_CPU_ISA=" + cap +
         " set as well (a CPU without AVX-512 has no AMX; torch's bf16 attention fails on that pairing)";
}

namespace {

// The machine's paths of `dtype` where nothing pins them: widened without native kernels (nothing to measure); else
// the stored measurement of this machine, measured now when none is stored and `may_measure`; else the flag rule,
// which every process of a machine applies alike.
Choice machine_choice(c10::ScalarType dtype, bool may_measure) {
  const auto flags = cpu_flags(), cap = onednn_cap_env();
  const auto rule = [&](const std::string& why_not_measured) {
    const auto [path, why] = default_narrow_gemm_path(flags, cap);
    return Choice{{path, path, path}, why + why_not_measured};
  };
  if (!native_narrow_kernels(flags, cap, dtype)) return rule("");
  const auto folder = streambp_cache_folder();
  const auto probe = [&] {
    fmt::print(stderr, "measuring the {} GEMM paths of this machine once (a few seconds); stored in {}\n",
               dtype == at::kHalf ? "fp16" : "bf16", folder.string());
    return time_gemm_paths(dtype);
  };
  const auto stored = stored_gemm_paths(folder, running_gemm_key(dtype), probe,
                                        may_measure ? GemmStoreMode::reuse : GemmStoreMode::read_only);
  if (stored) return {stored->paths, stored->reason()};
  return rule(may_measure ? "; the measurement could not be stored"
                          : "; not measured by this process, none stored in " + folder.string());
}

}  // namespace

GemmPaths parse_gemm_paths(const std::string& description, const std::string& source) {
  GemmPaths p;
  std::size_t start = 0;
  int seen = 0;
  while (start < description.size()) {
    const auto comma = std::min(description.find(',', start), description.size());
    const auto item = description.substr(start, comma - start);
    const auto eq = item.find('=');
    if (eq == std::string::npos) throw InputError(source + ": GEMM paths '" + description + "': expected nt=..,nn=..,tn=..");
    const auto key = item.substr(0, eq);
    const auto path = parse_path(item.substr(eq + 1), source);
    if (key == "nt") p.nt = path;
    else if (key == "nn") p.nn = path;
    else if (key == "tn") p.tn = path;
    else throw InputError(source + ": GEMM paths: unknown layout '" + key + "' (nt, nn, tn)");
    ++seen;
    start = comma + 1;
  }
  if (seen != 3) throw InputError(source + ": GEMM paths '" + description + "': expected nt, nn and tn");
  return p;
}

namespace {

std::mutex choices_mutex;
std::map<c10::ScalarType, Choice>& choices() {
  static std::map<c10::ScalarType, Choice> table;
  return table;
}

const Choice& choice(c10::ScalarType dtype) {
  static const Choice never_widened{{}, ""};
  if (!is_narrow(dtype)) return never_widened;
  std::lock_guard<std::mutex> lock(choices_mutex);
  auto& table = choices();
  auto it = table.find(dtype);
  if (it == table.end()) {
    const auto env = env_or_empty("STREAMBP_NARROW_GEMM");
    Choice c;
    if (env.empty()) {
      c = machine_choice(dtype, gemm_probe_allowed());
    } else {
      const auto path = parse_path(env, "STREAMBP_NARROW_GEMM");
      c.paths = {path, path, path};
      c.reason = "pinned by STREAMBP_NARROW_GEMM=" + env;
    }
    it = table.emplace(dtype, c).first;
  }
  return it->second;
}

// y = x·wᵀ + bias in fp32 arithmetic on the widened operands where a layout's path says so, each product rounded once
// into the narrow dtype. Saves what at::linear's autograd saves: x when w needs a gradient, w when x does.
struct PathLinear : public torch::autograd::Function<PathLinear> {
  // bias: optional, as an undefined tensor is no valid input of a custom function.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const std::optional<at::Tensor>& bias_input) {
    const at::Tensor bias = bias_input.value_or(at::Tensor());
    ctx->save_for_backward({w.requires_grad() ? x : at::Tensor(), x.requires_grad() ? w : at::Tensor()});
    ctx->saved_data["bias"] = bias.defined();
    const auto k = x.size(-1);
    const auto x2 = x.reshape({-1, k});  // [rows, k]
    // The bias inside the product, as at::linear's addmm: one rounding of bias + x·wᵀ.
    const auto dtype = x.scalar_type();
    const auto y = !widened(x, GemmLayout::nt)
                       ? (bias.defined() ? at::addmm(bias, x2, w.t()) : at::mm(x2, w.t()))
                       : (bias.defined() ? at::addmm(bias.to(at::kFloat), x2.to(at::kFloat), w.to(at::kFloat).t())
                                         : at::mm(x2.to(at::kFloat), w.to(at::kFloat).t()))
                             .to(dtype);
    auto sizes = x.sizes().vec();
    sizes.back() = w.size(0);
    return y.view(sizes);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& w = saved[1];
    const auto g = grads[0].reshape({-1, grads[0].size(-1)});  // [rows, n]
    at::Tensor dx, dw, db;
    if (w.defined()) {  // x needed a gradient
      auto sizes = grads[0].sizes().vec();
      sizes.back() = w.size(1);
      dx = gemm(g, w, GemmLayout::nn).view(sizes);
    }
    // [n, k] as the transpose of xᵀ·g ([k, n]), the layout autograd's own linear backward leaves: the gradient's
    // accumulation then copies it as it copies the native one (the memory models count that copy).
    if (x.defined()) dw = gemm(x.reshape({-1, x.size(-1)}).t(), g, GemmLayout::tn).t();
    if (ctx->saved_data["bias"].toBool()) db = g.sum(0);
    return {dx, dw, db};
  }
};

}  // namespace

GemmPath GemmPaths::of(GemmLayout layout) const {
  return layout == GemmLayout::nt ? nt : layout == GemmLayout::nn ? nn : tn;
}

std::string GemmPaths::describe() const {
  return fmt::format("nt={},nn={},tn={}", name(nt), name(nn), name(tn));
}

const GemmPaths& gemm_paths(c10::ScalarType dtype) { return choice(dtype).paths; }

std::pair<GemmPaths, std::string> machine_gemm_paths(c10::ScalarType dtype) {
  if (!is_narrow(dtype)) return {GemmPaths{}, ""};
  const auto c = machine_choice(dtype, false);
  return {c.paths, c.reason};
}

std::string gemm_paths_reason(c10::ScalarType dtype) { return choice(dtype).reason; }

std::map<std::string, std::pair<std::string, std::string>> chosen_gemm_paths() {
  std::lock_guard<std::mutex> lock(choices_mutex);
  std::map<std::string, std::pair<std::string, std::string>> out;
  for (const auto& [dtype, c] : choices()) out[dtype == at::kBFloat16 ? "bf16" : "fp16"] = {c.paths.describe(), c.reason};
  return out;
}

void pin_gemm_paths(c10::ScalarType dtype, const std::string& description, const std::string& source) {
  if (!is_narrow(dtype)) return;
  const auto paths = parse_gemm_paths(description, source);
  std::lock_guard<std::mutex> lock(choices_mutex);
  choices()[dtype] = {paths, "pinned by " + source};
}

bool widened(const at::Tensor& a, GemmLayout layout) {
  return is_narrow(a.scalar_type()) && a.is_cpu() && gemm_paths(a.scalar_type()).of(layout) == GemmPath::widened;
}

at::Tensor gemm(const at::Tensor& a, const at::Tensor& b, GemmLayout layout) {
  // Both fp32 copies and the fp32 product are alive when the product is rounded: the scratch the calibration counts.
  return widened(a, layout) ? at::mm(a.to(at::kFloat), b.to(at::kFloat)).to(a.scalar_type()) : at::mm(a, b);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  const auto dtype = x.scalar_type();
  if (!is_narrow(dtype) || !x.is_cpu() || !gemm_paths(dtype).any_widened()) return at::linear(x, w, bias);
  return PathLinear::apply(x, w, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
}

}  // namespace sbp
