#include "profiler/calibration.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/autograd.h>

#include "core/methods/phase.h"
#include "core/model/gemm.h"
#include "profiler/cpu_meter.h"
#include "profiler/cuda_meter.h"
#include "core/io/input_error.h"

namespace sbp {
namespace {

struct Probe {
  KernelCall call;      // what the model asked
  std::string probed;   // the shape(s) actually run
  std::int64_t bytes = 0;
  bool extrapolated = false;
  double seconds = 0;
};

// Runs `op` under the device's meter and returns the peak bytes it added beyond what was live before it and what it
// left alive (its outputs, returned by `op` as their byte count). On the CPU the peak is the coincident one: every
// intra-op thread at its own worst moment at once, as a long call of the same kernel reaches (a probe is short).
template <typename Op>
std::int64_t bytes_beyond_outputs(c10::Device device, Op&& op) {
  if (device.is_cuda()) {
    auto& meter = CudaMemoryMeter::for_device(device.index());
    if (!meter.available()) throw InputError("kernel calibration: CUDA memory meter: " + meter.reason());
    synchronize(device);
    const auto before = meter.current_bytes();
    meter.reset_peak();
    const std::int64_t outputs = op();
    synchronize(device);
    return std::max<std::int64_t>(0, meter.peak_bytes() - before - outputs);
  }
  auto& meter = CpuMemoryMeter::install();
  meter.reset_peak();
  const std::int64_t outputs = op();
  return std::max<std::int64_t>(0, meter.coincident_peak_bytes() - outputs);
}

// A [rows, cols] operand, or the transpose of a [cols, rows] one.
at::Tensor operand(std::int64_t rows, std::int64_t cols, bool transposed, const at::TensorOptions& options) {
  return transposed ? at::ones({cols, rows}, options).t() : at::ones({rows, cols}, options);
}

std::int64_t gemm_bytes(c10::Device device, const KernelCall& c, std::int64_t m, std::int64_t n, std::int64_t k) {
  const auto options = at::TensorOptions().dtype(c.dtype).device(device);
  const auto a = operand(m, k, c.a_transposed, options), b = operand(k, n, c.b_transposed, options);
  return bytes_beyond_outputs(device, [&] { return std::int64_t(at::mm(a, b).nbytes()); });
}

void probe_native_gemm(c10::Device device, Probe& p);

// A product on the widened path (core/model/gemm.h) is an fp32 product of fp32 copies of both operands: its scratch is
// the fp32 kernel's, probed at the same shape, plus those copies and the fp32 product, all alive when the product is
// rounded into the narrow output (4 (mk + kn + mn) bytes: arithmetic, exact at any size, where a probe shortened to
// a few thousand rows would see operands of that size).
void probe_gemm(c10::Device device, Probe& p) {
  const auto& c = p.call;
  const bool narrow = c.dtype == at::kBFloat16 || c.dtype == at::kHalf;
  const auto layout = c.a_transposed ? GemmLayout::tn : c.b_transposed ? GemmLayout::nt : GemmLayout::nn;
  if (!narrow || device.is_cuda() || gemm_paths(c.dtype).of(layout) == GemmPath::native) return probe_native_gemm(device, p);
  Probe fp32{KernelCall::gemm(at::kFloat, c.threads, c.m, c.n, c.k, c.a_transposed, c.b_transposed)};
  probe_native_gemm(device, fp32);
  p.bytes = fp32.bytes + 4 * (c.m * c.k + c.k * c.n + c.m * c.n);
  p.probed = "widened: fp32 " + fp32.probed + " + the fp32 operands and product";
  p.extrapolated = fp32.extrapolated;
}

void probe_native_gemm(c10::Device device, Probe& p) {
  const auto& c = p.call;
  auto m = c.m, n = c.n, k = c.k;
  const auto cost = [&] { return m * n * k; };
  // Shorten the reduction first (to 4096, then to 256 if the output alone is that large), then the output.
  if (cost() > kProbeMultiplyAdds) k = std::min(k, std::max<std::int64_t>(4096, kProbeMultiplyAdds / (m * n)));
  if (cost() > kProbeMultiplyAdds) k = std::min(k, std::max<std::int64_t>(256, kProbeMultiplyAdds / (m * n)));
  while (cost() > kProbeMultiplyAdds && std::max(m, n) > 1) (m >= n ? m : n) = (std::max(m, n) + 1) / 2;
  p.probed = fmt::format("[{} x {}] x [{} x {}]", m, k, k, n);
  p.bytes = gemm_bytes(device, c, m, n, k);
  if (m == c.m && n == c.n) return;
  // Linear in output elements from a second probe at half the output.
  const auto m2 = m >= n ? (m + 1) / 2 : m, n2 = m >= n ? n : (n + 1) / 2;
  const auto half = gemm_bytes(device, c, m2, n2, k);
  const double slope = std::max(0.0, double(p.bytes - half) / double(m * n - m2 * n2));
  p.bytes += std::int64_t(slope * double(c.m * c.n - m * n));
  p.extrapolated = true;
  p.probed += fmt::format(" and [{} x {}] x [{} x {}]", m2, k, k, n2);
}

// Through SDPA and autograd, as the full-sequence methods call it (on the CPU the same flash kernel that chunk
// attention calls directly).
void probe_attention_backward(c10::Device device, Probe& p) {
  const auto& c = p.call;
  // The CPU kernel's backward runs one (batch row, K/V head) per worker, the group of query heads inside it: as many
  // K/V heads as the threads can take (at B = 1 with 2 K/V heads, 2 threads work; with 1, one does).
  const auto group = c.heads / std::max<std::int64_t>(1, c.kv_heads);
  const auto kv_heads = std::min(c.batch * c.kv_heads, std::max<std::int64_t>(1, c.threads));
  const auto heads = kv_heads * group;
  // A causal call keeps its square shape (the diagonal blocks are what make it causal).
  const auto keys = std::min<std::int64_t>(c.keys, 1024), queries = c.causal ? keys : std::min<std::int64_t>(c.queries, 768);
  p.probed = fmt::format("B=1 heads={}/{} queries={} keys={}{}", heads, kv_heads, queries, keys, c.causal ? " causal" : "");
  // The model's layout: q, k, v are [B, T, heads, hd] blocks seen as [B, heads, T, hd] (the projections' output,
  // transposed), so the kernel's block GEMMs run with row strides of heads x hd (their scratch depends on it).
  const auto options = at::TensorOptions().dtype(c.dtype).device(device);
  const auto input = [&](std::int64_t n, std::int64_t h) {
    return at::ones({1, n, h, c.head_dim}, options).transpose(1, 2).requires_grad_(true);
  };
  const auto q = input(queries, heads), k = input(keys, kv_heads), v = input(keys, kv_heads);
  const auto o = at::scaled_dot_product_attention(q, k, v, {}, 0.0, c.causal, {}, /*enable_gqa=*/group > 1);
  const auto grad_o = at::ones_like(o);
  p.bytes = bytes_beyond_outputs(device, [&] {
    const auto grads = torch::autograd::grad({o}, {q, k, v}, {grad_o});
    std::int64_t outputs = 0;
    for (const auto& g : grads) outputs += std::int64_t(g.nbytes());
    return outputs;
  });
}

// Sets the intra-op thread count for one scope (a probe runs at the threads of the workload it answers for).
class ThreadsScope {
 public:
  explicit ThreadsScope(std::int64_t threads) : previous_(at::get_num_threads()) {
    if (threads > 0 && threads != previous_) at::set_num_threads(int(threads));
  }
  ~ThreadsScope() {
    if (at::get_num_threads() != previous_) at::set_num_threads(previous_);
  }
  ThreadsScope(const ThreadsScope&) = delete;
  ThreadsScope& operator=(const ThreadsScope&) = delete;

 private:
  int previous_;
};

class MeasuredWorkspaces final : public KernelWorkspaces {
 public:
  explicit MeasuredWorkspaces(c10::Device device) : device_(device) {}

  std::int64_t bytes(const KernelCall& call) const override {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto key = call.describe();
    if (const auto it = probes_.find(key); it != probes_.end()) return it->second.bytes;
    Probe p{call};
    const auto start = std::chrono::steady_clock::now();
    {
      const ThreadsScope threads(call.threads);
      call.op == KernelCall::Op::gemm ? probe_gemm(device_, p) : probe_attention_backward(device_, p);
    }
    p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    order_.push_back(key);
    return probes_.emplace(key, std::move(p)).first->second.bytes;
  }

  std::string source() const override { return "measured on the running machine (" + device_.str() + ")"; }

  std::vector<Probe> probes() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    std::vector<Probe> out;
    for (const auto& key : order_) out.push_back(probes_.at(key));
    return out;
  }

 private:
  c10::Device device_;
  mutable std::mutex mutex_;
  mutable std::map<std::string, Probe> probes_;
  mutable std::vector<std::string> order_;  // probes in the order they ran
};

// lscpu's flags that decide which kernels run (oneDNN and ATen dispatch on them).
std::vector<std::string> isa_flags() {
  static const std::vector<std::string> relevant = {"avx",        "avx2",        "fma",         "avx512f",
                                                    "avx512bw",   "avx512_vnni", "avx512_bf16", "avx512_fp16",
                                                    "amx_tile",   "amx_bf16",    "amx_int8"};
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    std::vector<std::string> have, out;
    for (std::string w; words >> w;) have.push_back(w);
    for (const auto& f : relevant)
      if (std::find(have.begin(), have.end(), f) != have.end()) out.push_back(f);
    return out;
  }
  return {};
}

std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

}  // namespace

std::shared_ptr<const KernelWorkspaces> machine_workspaces(c10::Device device) {
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<const KernelWorkspaces>> by_device;
  const std::lock_guard<std::mutex> lock(mutex);
  auto& entry = by_device[device.str()];
  if (!entry) entry = std::make_shared<const MeasuredWorkspaces>(device);
  return entry;
}

std::string cpu_isa_summary() {
  std::string out;
  for (const auto& f : isa_flags()) out += (out.empty() ? "" : " ") + f;
  out += " (ATen " + at::get_cpu_capability();
  for (const char* limit : {"ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"})
    if (const auto v = env_or_empty(limit); !v.empty()) out += std::string("; ") + limit + "=" + v;
  return out + ")";
}

nlohmann::json calibration_json(const KernelWorkspaces& workspaces) {
  nlohmann::json j = {{"source", workspaces.source()},
                      {"cpu_flags", isa_flags()},
                      {"aten_cpu_capability", at::get_cpu_capability()},
                      {"onednn_max_cpu_isa", env_or_empty("ONEDNN_MAX_CPU_ISA")},
                      {"aten_cpu_capability_limit", env_or_empty("ATEN_CPU_CAPABILITY")}};
  auto probes = nlohmann::json::array();
  if (const auto* measured = dynamic_cast<const MeasuredWorkspaces*>(&workspaces))
    for (const auto& p : measured->probes())
      probes.push_back({{"call", p.call.describe()}, {"probed", p.probed}, {"bytes", p.bytes},
                        {"extrapolated", p.extrapolated}, {"seconds", p.seconds}});
  j["probes"] = probes;
  j["narrow_gemm"] = narrow_gemm_json();
  return j;
}

nlohmann::json narrow_gemm_json() {
  auto narrow = nlohmann::json::object();
  for (const auto& [dtype, choice] : chosen_gemm_paths()) narrow[dtype] = {{"paths", choice.first}, {"reason", choice.second}};
  return narrow;
}

}  // namespace sbp
