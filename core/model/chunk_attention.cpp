#include "core/model/chunk_attention.h"
#include "core/model/chunk_attention_kernels.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "core/io/input_error.h"

namespace sbp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Blocks of a bf16/fp16 chunk (the CPU's path; CUDA sends 16-bit chunks to the whole-chunk kernel) are computed in
// fp32: each block's output would otherwise be rounded to 16 bits before the merge, one rounding more than a single
// SDPA call makes (measured: 2.5x standard BP's bf16 error on a q bias). The prefix is upcast tile by tile
// (kPrefixTile keys at a time), never as a whole: a full-prefix fp32 copy of K and V per chunk was +64% of the bf16
// peak on `tiny` at T = 4096 (issue #8). fp32 and fp64 run as they are, the prefix in one block.
constexpr std::int64_t kPrefixTile = 1024;

bool upcasts(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf; }
at::Tensor upcast(const at::Tensor& t) { return upcasts(t) ? t.to(at::kFloat) : t; }

// Key blocks [start, start + length) of a chunk with queries at [q_start, q_start + c): the prefix in tiles, then the
// causal diagonal block [q_start, q_start + c).
struct KeyBlock {
  std::int64_t start, length;
  bool causal;
};
std::vector<KeyBlock> key_blocks(std::int64_t q_start, std::int64_t c, bool tiled) {
  std::vector<KeyBlock> blocks;
  const auto tile = tiled ? kPrefixTile : q_start;
  for (std::int64_t s = 0; s < q_start; s += tile) blocks.push_back({s, std::min(tile, q_start - s), false});
  blocks.push_back({q_start, c, true});
  return blocks;
}

// K/V rows [start, start + length) in the compute dtype, expanded to the query's head count when the kernel needs it
// (a copy of the tile: GQA heads cannot be expanded as a strided view).
at::Tensor kv_block(const AttentionKernel& kernel, const at::Tensor& kv, const KeyBlock& b, std::int64_t heads) {
  auto block = kernel.narrow_operands ? kv.narrow(2, b.start, b.length) : upcast(kv.narrow(2, b.start, b.length));
  if (!kernel.needs_equal_heads || kv.size(1) == heads) return block;
  const auto group = heads / kv.size(1);
  return block.unsqueeze(2).expand({kv.size(0), kv.size(1), group, b.length, kv.size(3)}).reshape(
      {kv.size(0), heads, b.length, kv.size(3)});
}

// The inverse of kv_block's expansion for a gradient: each K/V head's gradient is the sum over its query heads.
at::Tensor kv_block_grad(const at::Tensor& grad, std::int64_t kv_heads) {
  if (grad.size(1) == kv_heads) return grad;
  return grad.unflatten(1, {kv_heads, grad.size(1) / kv_heads}).sum(2);
}

struct PrefixAndDiagonal : torch::autograd::Function<PrefixAndDiagonal> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q_in, const at::Tensor& k_in,
                            const at::Tensor& v_in, std::int64_t q_start, double scale, const KVGradSums* sums,
                            const AttentionKernel* kernel) {
    const auto q = kernel->narrow_operands ? q_in : upcast(q_in);
    const auto heads = q.size(1);
    at::Tensor o, lse;  // the merge so far: [B, n_h, c, hd] and [B, n_h, c], >= fp32
    for (const auto& b : key_blocks(q_start, q.size(2), kernel->tiles_prefix || upcasts(k_in))) {
      const auto [o_b, lse_b] = kernel->forward(q, kv_block(*kernel, k_in, b, heads), kv_block(*kernel, v_in, b, heads),
                                                b.causal, scale);
      if (!o.defined()) {
        o = o_b.to(lse_b.scalar_type());
        lse = lse_b;
        continue;
      }
      // Softmax over the union of the key sets: weights exp(lse_block - lse).
      const auto merged = at::logaddexp(lse, lse_b);
      o = at::exp(lse - merged).unsqueeze(-1) * o + at::exp(lse_b - merged).unsqueeze(-1) * o_b.to(o.scalar_type());
      lse = merged;
    }
    // The backward needs the exact merged output: kept in its (>= fp32) merge dtype, chunk-sized.
    ctx->save_for_backward({q_in, k_in, v_in, o, lse});
    ctx->saved_data["q_start"] = q_start;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["kernel"] = reinterpret_cast<std::int64_t>(kernel);
    if (sums) ctx->saved_data["sums"] = at::IValue(std::vector<at::Tensor>{sums->dK, sums->dV});
    return o.to(q_in.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& k_in = saved[1];
    const auto& v_in = saved[2];
    const auto* kernel = reinterpret_cast<const AttentionKernel*>(ctx->saved_data["kernel"].toInt());
    const auto q = kernel->narrow_operands ? saved[0] : upcast(saved[0]);
    const auto o = saved[3].to(upcast(saved[0]).scalar_type());
    const auto& lse = saved[4];
    const auto q_start = ctx->saved_data["q_start"].toInt();
    const auto scale = ctx->saved_data["scale"].toDouble();
    const auto grad_o = kernel->narrow_operands ? grads[0].contiguous() : upcast(grads[0]).contiguous();
    const auto heads = q.size(1), kv_heads = k_in.size(1);
    // With the merged o and lse, P = exp(S - lse) and rowsum(dO * O) are those of the whole softmax, so each
    // block's backward returns its exact part of dQ and the exact dK, dV of its keys: added into the sums, or
    // written into the gradients of K and V (no concatenation).
    const bool to_sums = ctx->saved_data.count("sums") > 0;
    at::Tensor dq, dk, dv;
    if (to_sums) {
      const auto sums = ctx->saved_data["sums"].toTensorVector();
      dk = sums[0], dv = sums[1];
    } else {
      dk = at::empty_like(k_in, at::MemoryFormat::Contiguous), dv = at::empty_like(v_in, at::MemoryFormat::Contiguous);
    }
    for (const auto& b : key_blocks(q_start, q.size(2), kernel->tiles_prefix || upcasts(k_in))) {
      const auto [dq_b, dk_e, dv_e] = kernel->backward(grad_o, q, kv_block(*kernel, k_in, b, heads),
                                                       kv_block(*kernel, v_in, b, heads), o, lse, b.causal, scale);
      const auto dk_b = kv_block_grad(dk_e, kv_heads), dv_b = kv_block_grad(dv_e, kv_heads);
      dq = dq.defined() ? dq.add_(dq_b) : dq_b;
      if (to_sums) {
        dk.narrow(2, b.start, b.length).add_(dk_b);
        dv.narrow(2, b.start, b.length).add_(dv_b);
      } else {
        dk.narrow(2, b.start, b.length).copy_(dk_b);
        dv.narrow(2, b.start, b.length).copy_(dv_b);
      }
    }
    if (to_sums) dk = dv = at::Tensor();
    return {dq.to(saved[0].scalar_type()), dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::pair<at::Tensor, at::Tensor> cpu_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              bool causal, double scale) {
  auto [o, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, {}, scale);
  return {o, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_backward(const at::Tensor& grad_o, const at::Tensor& q,
                                                            const at::Tensor& k, const at::Tensor& v,
                                                            const at::Tensor& o, const at::Tensor& lse, bool causal,
                                                            double scale) {
  return at::_scaled_dot_product_flash_attention_for_cpu_backward(grad_o, q, k, v, o, lse, 0.0, causal, {}, scale);
}

// The memory-efficient kernel's log-sum-exp rows are padded to a multiple of 32 queries on CUDA; its backward reads
// the padded layout.
constexpr std::int64_t kLseAlign = 32;

void check_cuda_inputs(const at::Tensor& q) {
  TORCH_CHECK(q.scalar_type() == at::kFloat,
              "chunk attention on CUDA runs its memory-efficient blocks in fp32 (bf16/fp16 take the flash whole-chunk "
              "kernel); ", c10::toString(q.scalar_type()), " is not supported by the memory-efficient kernel (fp64 "
              "runs on the CPU: --device cpu)");
  TORCH_CHECK(q.size(-1) % 4 == 0, "chunk attention on CUDA: head_dim ", q.size(-1),
              " is not a multiple of 4, which the memory-efficient kernel needs in fp32");
}

std::pair<at::Tensor, at::Tensor> cuda_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               bool causal, double scale) {
  check_cuda_inputs(q);
  // Square blocks only, so the kernel's top-left causal rule is the bottom-right one.
  auto [o, lse, seed, offset] =
      at::_scaled_dot_product_efficient_attention(q, k, v, {}, /*compute_log_sumexp=*/true, 0.0, causal, scale);
  return {o, lse.narrow(-1, 0, q.size(2))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cuda_backward(const at::Tensor& grad_o, const at::Tensor& q,
                                                             const at::Tensor& k, const at::Tensor& v,
                                                             const at::Tensor& o, const at::Tensor& lse, bool causal,
                                                             double scale) {
  const auto c = q.size(2);  // q was checked by cuda_forward
  auto lse_padded = at::zeros({lse.size(0), lse.size(1), (c + kLseAlign - 1) / kLseAlign * kLseAlign}, lse.options());
  lse_padded.narrow(-1, 0, c).copy_(lse);
  const auto no_dropout = at::zeros({}, at::TensorOptions().dtype(at::kLong));  // seed and offset, unused at p = 0
  auto [dq, dk, dv, dbias] = at::_scaled_dot_product_efficient_attention_backward(
      grad_o, q, k, v, at::Tensor(), o, lse_padded, no_dropout, no_dropout, 0.0, {true, true, true, false}, causal,
      scale);
  return {dq, dk, dv};
}

}  // namespace

const AttentionKernel& cpu_attention_kernel() {
  static const AttentionKernel kernel{"cpu flash", false, false, cpu_forward, cpu_backward};
  return kernel;
}

const AttentionKernel& cuda_attention_kernel() {
  static const AttentionKernel kernel{"cuda memory-efficient", true, true, cuda_forward, cuda_backward};
  return kernel;
}

namespace {
// ScopedCpuWholeChunkKernel's kernel, if one is alive.
const WholeChunkKernel* cpu_whole_chunk_override = nullptr;

// STREAMBP_CPU_BF16_ATTENTION: unset or "bf16" takes the bf16 kernel where it is available, "fp32" pins the fp32
// blocks (the kernel of every CPU before it, and of CPUs without native bf16 GEMMs still).
bool cpu_bf16_blocks_wanted() {
  static const bool wanted = [] {
    const char* v = std::getenv("STREAMBP_CPU_BF16_ATTENTION");
    const std::string value = v ? v : "";
    if (value.empty() || value == "bf16") return true;
    if (value == "fp32") return false;
    throw InputError("STREAMBP_CPU_BF16_ATTENTION=" + value + ": expected bf16 (the default) or fp32");
  }();
  return wanted;
}
}  // namespace

ScopedCpuWholeChunkKernel::ScopedCpuWholeChunkKernel(const WholeChunkKernel& kernel)
    : previous_(cpu_whole_chunk_override) {
  cpu_whole_chunk_override = &kernel;
}

ScopedCpuWholeChunkKernel::~ScopedCpuWholeChunkKernel() { cpu_whole_chunk_override = previous_; }

ChunkAttentionChoice choose_chunk_attention(c10::DeviceType device, c10::ScalarType dtype) {
  TORCH_CHECK(device == c10::DeviceType::CPU || device == c10::DeviceType::CUDA, "chunk_attention: no kernel for device ",
              device);
  const bool sixteen_bit = dtype == at::kBFloat16 || dtype == at::kHalf;
  if (device == c10::DeviceType::CUDA)
    return sixteen_bit ? ChunkAttentionChoice{nullptr, &cuda_whole_chunk_kernel()}
                       : ChunkAttentionChoice{&cuda_attention_kernel(), nullptr};
  if (sixteen_bit && cpu_whole_chunk_override) return {nullptr, cpu_whole_chunk_override};
  // bf16 blocks on bf16 operands where oneDNN has native bf16 kernels (a property of the CPU and ONEDNN_MAX_CPU_ISA,
  // never of a timing: the kernel changes the bits). Otherwise the CPU keeps fp32 blocks of upcast copies for bf16
  // (fp16 too). Both hand dK/dV to the sums in fp32, with no rounding per chunk.
  if (dtype == at::kBFloat16 && cpu_bf16_blocks_wanted() && cpu_bf16_attention_available())
    return {&cpu_bf16_attention_kernel(), nullptr};
  return {&cpu_attention_kernel(), nullptr};
}

at::Tensor chunk_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::int64_t q_start,
                           double scale, const KVGradSums* sums) {
  const auto choice = choose_chunk_attention(q.device().type(), q.scalar_type());
  return choice.whole ? chunk_attention_with(*choice.whole, q, k, v, q_start, scale, sums)
                      : chunk_attention_with(*choice.blocks, q, k, v, q_start, scale, sums);
}

at::Tensor prefix_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::int64_t q_start,
                            double scale, const KVGradSums* sums) {
  if (q_start == 0 && !sums) {
    // Query at absolute position q_start+i sees keys j <= q_start+i (bottom-right aligned). SDPA's is_causal=true
    // aligns top-left: right for the square block at 0 only, and a [c, e] mask elsewhere would compute the masked
    // half of the diagonal block. chunk_attention does neither.
    const bool gqa = k.size(1) != q.size(1);
    return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, scale, gqa);
  }
  return chunk_attention(q, k, v, q_start, scale, sums);
}

namespace {

const AttentionKernel& block_kernel(const at::Tensor& q) {
  const auto choice = choose_chunk_attention(q.device().type(), q.scalar_type());
  TORCH_CHECK(choice.blocks, "the ring's attention runs block kernels; ", choice.name(), " (CUDA bf16/fp16) has none "
              "yet (issue #48): --sp-scheme allgather");
  return *choice.blocks;
}

// The tiles of a block of n keys: the block itself, or kPrefixTile keys at a time where chunk_attention tiles its
// prefix (a causal block is square and never tiled).
std::vector<KeyBlock> block_tiles(const AttentionKernel& kernel, const at::Tensor& k, std::int64_t n, bool causal) {
  if (causal) return {{0, n, true}};
  std::vector<KeyBlock> tiles;
  const auto tile = kernel.tiles_prefix || upcasts(k) ? kPrefixTile : n;
  for (std::int64_t s = 0; s < n; s += tile) tiles.push_back({s, std::min(tile, n - s), false});
  return tiles;
}

}  // namespace

void merge_key_block(SoftmaxState& state, const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                     bool causal, double scale) {
  const auto& kernel = block_kernel(q_in);
  const auto q = kernel.narrow_operands ? q_in : upcast(q_in);
  for (const auto& b : block_tiles(kernel, k, k.size(2), causal)) {
    const auto [o_b, lse_b] =
        kernel.forward(q, kv_block(kernel, k, b, q.size(1)), kv_block(kernel, v, b, q.size(1)), b.causal, scale);
    if (!state.o.defined()) {
      state = {o_b.to(lse_b.scalar_type()), lse_b};
      continue;
    }
    const auto merged = at::logaddexp(state.lse, lse_b);  // as PrefixAndDiagonal merges its blocks
    state.o = at::exp(state.lse - merged).unsqueeze(-1) * state.o +
              at::exp(lse_b - merged).unsqueeze(-1) * o_b.to(state.o.scalar_type());
    state.lse = merged;
  }
}

at::Tensor output_rowsum(const at::Tensor& grad_o, const at::Tensor& o) {
  return (grad_o.to(o.scalar_type()) * o).sum(-1);
}

// key_block_backward's tiles: kBackwardRows rows of a KV head's queries (its query heads' rows side by side) by
// kBackwardKeys keys, the block kernel's own tile on the CPU (32 queries by 512 keys), so that the scores it
// materialises stay as small as that kernel's scratch.
constexpr std::int64_t kBackwardRows = 32, kBackwardKeys = 512;

void key_block_backward(const at::Tensor& grad_o, const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                        const BackwardRows& rows, bool causal, double scale, at::Tensor& dq, at::Tensor& dk,
                        at::Tensor& dv) {
  TORCH_CHECK(!causal || k.size(2) == q_in.size(2), "key_block_backward: a causal block of ", k.size(2), " keys for ",
              q_in.size(2), " queries");
  const auto B = q_in.size(0), heads = q_in.size(1), c = q_in.size(2), kv_heads = k.size(1), n = k.size(2);
  const auto m = heads / kv_heads * c;  // rows per KV head
  const auto dtype = upcast(q_in).scalar_type();
  // A KV head's query heads as rows of one matrix, [B, n_kv, g c, hd]: GQA needs no copy of K or V per group, and the
  // products over the rows sum a KV head's gradients over its query heads.
  const auto by_kv_head = [&](const at::Tensor& x) { return x.to(dtype).reshape({B, kv_heads, m, x.size(-1)}); };
  const auto q = by_kv_head(q_in), dO = by_kv_head(grad_o);
  const auto lse = by_kv_head(rows.lse.unsqueeze(-1)), D = by_kv_head(rows.rowsum.unsqueeze(-1));
  auto dq_rows = at::zeros_like(q);
  const auto query_of_row = at::arange(m, at::TensorOptions().dtype(at::kLong).device(q.device())).remainder_(c);
  for (std::int64_t s = 0; s < n; s += kBackwardKeys) {
    const auto len = std::min(kBackwardKeys, n - s);
    const auto kt = k.narrow(2, s, len).to(dtype), vt = v.narrow(2, s, len).to(dtype);
    auto dk_t = dk.narrow(2, s, len), dv_t = dv.narrow(2, s, len);
    for (std::int64_t r = 0; r < m; r += kBackwardRows) {
      const auto rt = std::min(kBackwardRows, m - r);
      const auto qr = q.narrow(2, r, rt), dOr = dO.narrow(2, r, rt);
      auto p = at::matmul(qr, kt.transpose(-1, -2)).mul_(scale);  // scores [B, n_kv, rt, len]
      if (causal) {  // key s + j after the row's query: masked
        const auto keys = at::arange(s, s + len, query_of_row.options());
        p.masked_fill_(keys.unsqueeze(0) > query_of_row.narrow(0, r, rt).unsqueeze(1),
                       -std::numeric_limits<double>::infinity());
      }
      p.sub_(lse.narrow(2, r, rt)).exp_();  // P, the whole softmax's
      dv_t.add_(at::matmul(p.transpose(-1, -2), dOr));
      auto ds = at::matmul(dOr, vt.transpose(-1, -2)).sub_(D.narrow(2, r, rt)).mul_(p);  // dS = P (dP - D)
      p = at::Tensor();
      dq_rows.narrow(2, r, rt).add_(at::matmul(ds, kt).mul_(scale));
      dk_t.add_(at::matmul(ds.transpose(-1, -2), qr).mul_(scale));
    }
  }
  dq.add_(dq_rows.view({B, heads, c, q_in.size(3)}));
}

at::Tensor chunk_attention_with(const AttentionKernel& kernel, const at::Tensor& q, const at::Tensor& k,
                                const at::Tensor& v, std::int64_t q_start, double scale, const KVGradSums* sums) {
  TORCH_CHECK((q_start > 0 || sums) && k.size(2) == q_start + q.size(2), "chunk_attention: keys must be [0, q_start + c)");
  TORCH_CHECK(!sums || (!k.requires_grad() && !v.requires_grad()),
              "chunk_attention: K/V gradients go into the sums; k and v must not require grad");
  return PrefixAndDiagonal::apply(q, k, v, q_start, scale, sums, &kernel);
}

}  // namespace sbp
