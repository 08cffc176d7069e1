#include "core/onednn/bf16_matmul.h"

#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>

#include <oneapi/dnnl/dnnl.hpp>

namespace sbp::onednn {
namespace {

dnnl::engine& engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

bool native_isa(dnnl::cpu_isa isa) {
  // cpu_isa values are bit sets of the ISAs they include; avx512_core_bf16 is contained in every AMX one.
  const auto bits = static_cast<unsigned>(isa), bf16 = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);
  return (bits & bf16) == bf16;
}

using Key = std::tuple<std::int64_t, std::int64_t, std::int64_t, bool, bool, float, bool>;

Key key_of(const MatmulShape& s) { return {s.m, s.n, s.k, s.a_transposed, s.b_transposed, s.alpha, s.accumulate}; }

std::string text(const MatmulShape& s) {
  return "[" + std::to_string(s.m) + " x " + std::to_string(s.k) + "]" + (s.a_transposed ? " (A^T)" : "") + " x [" +
         std::to_string(s.k) + " x " + std::to_string(s.n) + "]" + (s.b_transposed ? " (B^T)" : "");
}

struct Primitive {
  dnnl::memory::desc a, b, c, scratchpad;
  dnnl::matmul matmul;
};

// Descriptors of a batch of one matrix: the primitives the kernel was measured and checked with (fadfd53).
Primitive make(const MatmulShape& s) {
  using dt = dnnl::memory::data_type;
  const dnnl::memory::dims a_strides = s.a_transposed ? dnnl::memory::dims{s.m * s.k, 1, s.m}
                                                      : dnnl::memory::dims{s.m * s.k, s.k, 1};
  const dnnl::memory::dims b_strides = s.b_transposed ? dnnl::memory::dims{s.k * s.n, 1, s.k}
                                                      : dnnl::memory::dims{s.k * s.n, s.n, 1};
  const dnnl::memory::desc a({1, s.m, s.k}, dt::bf16, a_strides);
  const dnnl::memory::desc b({1, s.k, s.n}, dt::bf16, b_strides);
  const dnnl::memory::desc c({1, s.m, s.n}, dt::f32, {s.m * s.n, s.n, 1});
  dnnl::primitive_attr attr;
  // The caller's scratchpad, not the library's: by default oneDNN 2.x shares one between primitives, which threads
  // executing at once (the ranks of a multi-rank test in one process) would overwrite.
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (s.alpha != 1.0f) attr.set_output_scales(0, {s.alpha});
  if (s.accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), attr, engine());
  const std::string impl = pd.impl_info_str();
  if (impl.rfind("brg", 0) != 0)
    throw std::runtime_error("oneDNN has no native bf16 kernel for " + text(s) + " (it chose " + impl + ")");
  return {a, b, c, pd.scratchpad_desc(), dnnl::matmul(pd)};
}

// Primitives are made once per shape (a JIT compilation each); attention calls few shapes, many times. A node's
// address stays valid as the map grows.
const Primitive& primitive(const MatmulShape& shape) {
  static std::mutex mutex;
  static std::map<Key, Primitive> primitives;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = key_of(shape);
  auto it = primitives.find(key);
  if (it == primitives.end()) {
    try {
      it = primitives.emplace(key, make(shape)).first;
    } catch (const dnnl::error& e) {
      throw std::runtime_error("oneDNN refused a bf16 matmul " + text(shape) + ": " + e.what());
    }
  }
  return it->second;
}

}  // namespace

bool bf16_native() {
  static const bool native = native_isa(dnnl::get_effective_cpu_isa());
  return native;
}

std::string describe() {
  const auto* v = dnnl::version();
  return "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch) +
         (bf16_native() ? ", native bf16" : ", no native bf16 on this CPU under ONEDNN_MAX_CPU_ISA");
}

std::size_t scratchpad_bytes(const MatmulShape& shape) { return primitive(shape).scratchpad.get_size(); }

void matmul(const MatmulShape& shape, const std::uint16_t* a, const std::uint16_t* b, float* c, void* scratchpad) {
  const auto& p = primitive(shape);
  thread_local dnnl::stream stream(engine());
  const dnnl::memory am(p.a, engine(), const_cast<std::uint16_t*>(a)), bm(p.b, engine(), const_cast<std::uint16_t*>(b)),
      cm(p.c, engine(), c), sm(p.scratchpad, engine(), scratchpad);
  try {
    p.matmul.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}, {DNNL_ARG_SCRATCHPAD, sm}});
    stream.wait();
  } catch (const dnnl::error& e) {
    throw std::runtime_error("oneDNN bf16 matmul " + text(shape) + " failed (status " + std::to_string(int(e.status)) +
                             "): " + e.what());
  }
}

}  // namespace sbp::onednn
