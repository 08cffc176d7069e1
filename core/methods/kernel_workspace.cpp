#include "core/methods/kernel_workspace.h"

#include <fmt/format.h>

#include "core/io/dtype.h"

namespace sbp {

KernelCall KernelCall::gemm(c10::ScalarType dtype, std::int64_t threads, std::int64_t m, std::int64_t n,
                            std::int64_t k, bool a_transposed, bool b_transposed) {
  KernelCall c;
  c.op = Op::gemm;
  c.dtype = dtype;
  c.threads = threads;
  c.m = m, c.n = n, c.k = k;
  c.a_transposed = a_transposed, c.b_transposed = b_transposed;
  return c;
}

KernelCall KernelCall::attention_backward(c10::ScalarType dtype, std::int64_t threads, std::int64_t batch,
                                          std::int64_t heads, std::int64_t kv_heads, std::int64_t queries,
                                          std::int64_t keys, std::int64_t head_dim, bool causal) {
  KernelCall c;
  c.op = Op::attention_backward;
  c.dtype = dtype;
  c.threads = threads;
  c.batch = batch, c.heads = heads, c.kv_heads = kv_heads;
  c.queries = queries, c.keys = keys, c.head_dim = head_dim;
  c.causal = causal;
  return c;
}

std::string KernelCall::describe() const {
  if (op == Op::gemm)
    return fmt::format("gemm {} t{} [{} x {}]{} x [{} x {}]{}", dtype_name(dtype), threads, m, k,
                       a_transposed ? "^T" : "", k, n, b_transposed ? "^T" : "");
  return fmt::format("attention backward {} t{} B={} heads={}/{} queries={} keys={} hd={}{}", dtype_name(dtype),
                     threads, batch, heads, kv_heads, queries, keys, head_dim, causal ? " causal" : "");
}

namespace {

class NoWorkspaces final : public KernelWorkspaces {
 public:
  std::int64_t bytes(const KernelCall&) const override { return 0; }
  std::string source() const override { return "none"; }
};

}  // namespace

std::shared_ptr<const KernelWorkspaces> no_kernel_workspaces() {
  static const auto none = std::make_shared<const NoWorkspaces>();
  return none;
}

}  // namespace sbp
