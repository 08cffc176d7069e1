// The CPU's bf16 block kernel (chunk_attention_kernels.h): attention blocks on bf16 operands with fp32 accumulation
// and fp32 outputs, the products through oneDNN's native bf16 kernels (core/onednn/bf16_matmul.h), the softmax rows in
// between in fp32 (softmax_rows.h).
//
// What it rounds to bf16 is what standard BP's bf16 attention rounds too: the probabilities P before P·V and dPᵀ
// products, and the scores' gradient dS before dS·K and dSᵀ·Q. The block's output, its log-sum-exp and every
// gradient stay fp32 (the merge of key blocks and the K/V sums see no rounding per block, as with the fp32 blocks).
//
// GQA without copies: a K/V head's query heads are the rows of one matrix ([B·n_kv, g·c, hd], q's own memory order),
// so one product per K/V head serves its group and the products over the rows sum the group's dK, dV.
#include "core/model/chunk_attention_kernels.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <string>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "core/model/softmax_rows.h"
#include "core/onednn/bf16_matmul.h"

namespace sbp {
namespace {

// Rows of a K/V head's queries per product. A worker computes a tile's scores, probabilities and their gradient
// ([rows, n] fp32, twice, and bf16) while they are in its cache, as a flash kernel does: the products between the
// row passes have k = head_dim, too few operations per score to pay for a trip to memory.
constexpr std::int64_t kRowTile = 64;
std::int64_t row_tile_override = 0;  // ScopedBf16AttentionRowTile's
std::int64_t row_tile() { return row_tile_override > 0 ? row_tile_override : kRowTile; }

const std::uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const std::uint16_t*>(t.data_ptr()); }
std::uint16_t* bits(at::Tensor& t) { return reinterpret_cast<std::uint16_t*>(t.data_ptr()); }
float* f32(at::Tensor& t) { return t.data_ptr<float>(); }

// The operands as dense matrices, one per (batch row, K/V head): q [B·n_kv, g·c, hd] (q's own memory order once
// contiguous), k, v [B·n_kv, n, hd] (a tile of the cache, copied: oneDNN's native kernels take dense operands only).
// A tile of a matrix's rows is then dense too.
struct Operands {
  std::int64_t B, heads, kv_heads, c, n, hd, matrices, rows;  // rows = g·c per K/V head
  at::Tensor q, k, v;
};

Operands operands(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in) {
  TORCH_CHECK(q_in.scalar_type() == at::kBFloat16 && k_in.scalar_type() == at::kBFloat16 &&
                  v_in.scalar_type() == at::kBFloat16,
              "cpu bf16 blocks: bf16 operands only");
  Operands o;
  o.B = q_in.size(0), o.heads = q_in.size(1), o.c = q_in.size(2), o.hd = q_in.size(3);
  o.kv_heads = k_in.size(1), o.n = k_in.size(2);
  o.matrices = o.B * o.kv_heads, o.rows = o.heads / o.kv_heads * o.c;
  o.q = q_in.contiguous().view({o.matrices, o.rows, o.hd});
  o.k = k_in.contiguous().view({o.matrices, o.n, o.hd});
  o.v = v_in.contiguous().view({o.matrices, o.n, o.hd});
  return o;
}

// The keys a row tile [r0, r0 + rows) computes: all n, or in a causal block (square, n = c) only up to the last key
// its rows see. The keys past it are masked for every row of the tile, and their products would be exact zeros: a
// causal block's tiles do about half its work. A tile that wraps from one query head's rows to the next sees them all.
std::int64_t tile_keys(const Operands& x, std::int64_t r0, std::int64_t rows, bool causal) {
  if (!causal || r0 / x.c != (r0 + rows - 1) / x.c) return x.n;
  return (r0 + rows - 1) % x.c + 1;
}

// The three products of one matrix's row tile; a score block is [rows, keys], dense (row stride keys).
onednn::MatmulShape rows_by_keys(const Operands& x, std::int64_t rows, std::int64_t keys, float alpha) {
  onednn::MatmulShape s;  // S = alpha · X Yᵀ
  s.m = rows, s.n = keys, s.k = x.hd, s.b_transposed = true, s.alpha = alpha;
  return s;
}
onednn::MatmulShape block_by_kv(const Operands& x, std::int64_t rows, std::int64_t keys, float alpha) {
  onednn::MatmulShape s;  // alpha · block · KV
  s.m = rows, s.n = x.hd, s.k = keys, s.alpha = alpha;
  return s;
}
onednn::MatmulShape block_transposed_by_rows(const Operands& x, std::int64_t rows, std::int64_t keys, float alpha) {
  onednn::MatmulShape s;  // dV, dK += alpha · blockᵀ · rows (the first keys of dK, dV)
  s.m = keys, s.n = x.hd, s.k = rows, s.a_transposed = true, s.alpha = alpha, s.accumulate = true;
  return s;
}

ScoreRows score_rows(const Operands& x, std::int64_t r0, std::int64_t rows, std::int64_t keys, bool causal) {
  ScoreRows s;
  s.rows = rows, s.keys = keys, s.first_row = r0, s.period = causal ? x.c : 0;
  return s;
}

std::int64_t tile_rows(std::int64_t rows) { return std::min(row_tile(), rows); }
std::int64_t workers(std::int64_t tasks, std::int64_t threads) { return std::max<std::int64_t>(1, std::min(threads, tasks)); }

// The products of a row tile of `rows` queries over `keys` keys, in the order the kernel runs them (the scratch is
// sized from these very shapes). Forward: S = scale · Q Kᵀ, O = P V.
std::array<onednn::MatmulShape, 2> forward_products(const Operands& x, std::int64_t rows, std::int64_t keys,
                                                    float scale) {
  return {rows_by_keys(x, rows, keys, scale), block_by_kv(x, rows, keys, 1.0f)};
}
// Backward: S, dV += Pᵀ dO, dP = dO Vᵀ, dQ = scale · dS K, dK += scale · dSᵀ Q. dK and dV start at zero: a causal
// block's tiles reach different numbers of keys, so no one tile writes them all.
std::array<onednn::MatmulShape, 5> backward_products(const Operands& x, std::int64_t rows, std::int64_t keys,
                                                     float scale) {
  return {rows_by_keys(x, rows, keys, scale), block_transposed_by_rows(x, rows, keys, 1.0f),
          rows_by_keys(x, rows, keys, 1.0f), block_by_kv(x, rows, keys, scale),
          block_transposed_by_rows(x, rows, keys, scale)};
}

// oneDNN's scratchpad for the largest of a call's products, rounded up to a cache line: one per worker, in ATen's
// memory (the meter and the memory models see it).
std::int64_t pad_bytes(const Operands& x, float scale, bool backward, bool causal) {
  std::size_t bytes = 0;
  const auto tile = row_tile();
  const auto add = [&](std::int64_t r0) {
    const auto rows = std::min(tile, x.rows - r0), keys = tile_keys(x, r0, rows, causal);
    if (backward)
      for (const auto& p : backward_products(x, rows, keys, scale)) bytes = std::max(bytes, onednn::scratchpad_bytes(p));
    else
      for (const auto& p : forward_products(x, rows, keys, scale)) bytes = std::max(bytes, onednn::scratchpad_bytes(p));
  };
  if (causal) {
    for (std::int64_t r0 = 0; r0 < x.rows; r0 += tile) add(r0);  // their key counts differ
  } else {
    // The first tile, the second (the middle ones repeat its shapes) and the last.
    for (const auto r0 : {std::int64_t(0), tile, (x.rows - 1) / tile * tile})
      if (r0 < x.rows) add(r0);
  }
  return (std::int64_t(bytes) + 63) / 64 * 64;
}

// Every worker's scratch for its row tiles of n keys, allocated before the workers start (so that the peak does not
// depend on how their allocations interleave): [workers, tile rows x n] scores, their gradient (backward) in fp32 and
// the probabilities in bf16, and oneDNN's scratchpad, a worker's slice by its thread number.
struct Scratch {
  at::Tensor s, dp, p, pad;
  std::int64_t stride, pad_stride;

  Scratch(const Operands& x, std::int64_t tasks, const at::TensorOptions& bf16, float scale, bool backward, bool causal)
      : stride(tile_rows(x.rows) * x.n), pad_stride(pad_bytes(x, scale, backward, causal)),
        slots(workers(tasks, at::get_num_threads())) {
    s = at::empty({slots, stride}, bf16.dtype(at::kFloat)), p = at::empty({slots, stride}, bf16);
    if (backward) dp = at::empty({slots, stride}, bf16.dtype(at::kFloat));
    pad = at::empty({slots, pad_stride}, bf16.dtype(at::kByte));
  }
  float* scores() { return s.data_ptr<float>() + slot() * stride; }
  float* score_gradient() { return dp.data_ptr<float>() + slot() * stride; }
  std::uint16_t* probabilities() { return reinterpret_cast<std::uint16_t*>(p.data_ptr()) + slot() * stride; }
  void* onednn_pad() { return pad.data_ptr<std::uint8_t>() + slot() * pad_stride; }

 private:
  std::int64_t slots;
  // A worker's thread number; a call from inside another parallel region runs inline, on one slot.
  std::int64_t slot() const { return std::min<std::int64_t>(at::get_thread_num(), slots - 1); }
};

std::pair<at::Tensor, at::Tensor> bf16_forward(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                               bool causal, double scale) {
  const auto x = operands(q_in, k_in, v_in);
  const auto options = q_in.options().dtype(at::kFloat);
  auto o = at::empty({x.matrices, x.rows, x.hd}, options), lse = at::empty({x.matrices, x.rows}, options);
  const auto tile = row_tile(), tiles = (x.rows + tile - 1) / tile;
  // Every (matrix, row tile) is independent: one task each.
  Scratch w(x, x.matrices * tiles, q_in.options(), float(scale), false, causal);
  at::parallel_for(0, x.matrices * tiles, 1, [&](std::int64_t begin, std::int64_t end) {
    float* s = w.scores();
    std::uint16_t* p = w.probabilities();
    void* pad = w.onednn_pad();
    for (std::int64_t i = begin; i < end; ++i) {
      const auto m = i / tiles, r0 = i % tiles * tile, rows = std::min(tile, x.rows - r0);
      const auto row = m * x.rows + r0, keys = tile_keys(x, r0, rows, causal);
      const auto [scores, by_v] = forward_products(x, rows, keys, float(scale));
      onednn::matmul(scores, bits(x.q) + row * x.hd, bits(x.k) + m * x.n * x.hd, s, pad);
      softmax_rows_forward(score_rows(x, r0, rows, keys, causal), s, f32(lse) + row, p);
      onednn::matmul(by_v, p, bits(x.v) + m * x.n * x.hd, f32(o) + row * x.hd, pad);
    }
  });
  return {o.view({x.B, x.heads, x.c, x.hd}), lse.view({x.B, x.heads, x.c})};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bf16_backward(const at::Tensor& grad_o, const at::Tensor& q_in,
                                                             const at::Tensor& k_in, const at::Tensor& v_in,
                                                             const at::Tensor& o, const at::Tensor& lse_in,
                                                             bool causal, double scale) {
  const auto x = operands(q_in, k_in, v_in);
  const auto options = q_in.options().dtype(at::kFloat);
  const auto dO = grad_o.to(at::kBFloat16).contiguous().view({x.matrices, x.rows, x.hd});
  auto lse = lse_in.to(at::kFloat).contiguous();
  auto D = (dO.to(at::kFloat) * o.reshape({x.matrices, x.rows, x.hd})).sum(-1).contiguous();  // rowsum(dO * O), merged
  auto dq = at::empty({x.matrices, x.rows, x.hd}, options);
  auto dk = at::zeros({x.matrices, x.n, x.hd}, options), dv = at::zeros({x.matrices, x.n, x.hd}, options);
  const auto tile = row_tile();
  const auto fscale = float(scale);
  // One task per matrix: its row tiles add into the same dK, dV.
  Scratch w(x, x.matrices, q_in.options(), fscale, true, causal);
  at::parallel_for(0, x.matrices, 1, [&](std::int64_t begin, std::int64_t end) {
    float* s = w.scores();
    float* dp = w.score_gradient();
    std::uint16_t* p = w.probabilities();
    void* pad = w.onednn_pad();
    for (std::int64_t m = begin; m < end; ++m) {
      const auto* k = bits(x.k) + m * x.n * x.hd;
      const auto* v = bits(x.v) + m * x.n * x.hd;
      auto* dk_m = f32(dk) + m * x.n * x.hd;
      auto* dv_m = f32(dv) + m * x.n * x.hd;
      for (std::int64_t r0 = 0; r0 < x.rows; r0 += tile) {
        const auto rows = std::min(tile, x.rows - r0), row = m * x.rows + r0, keys = tile_keys(x, r0, rows, causal);
        const auto shape = score_rows(x, r0, rows, keys, causal);
        const auto* q = bits(x.q) + row * x.hd;
        const auto* dO_rows = bits(dO) + row * x.hd;
        const auto [scores, to_dv, to_dp, to_dq, to_dk] = backward_products(x, rows, keys, fscale);
        onednn::matmul(scores, q, k, s, pad);
        probabilities_from_lse(shape, s, f32(lse) + row, p);
        onednn::matmul(to_dv, p, dO_rows, dv_m, pad);
        onednn::matmul(to_dp, dO_rows, v, dp, pad);
        score_gradient_rows(shape, s, dp, f32(D) + row, p);  // dS, over P's bf16 copy
        onednn::matmul(to_dq, p, k, f32(dq) + row * x.hd, pad);
        onednn::matmul(to_dk, p, q, dk_m, pad);
      }
    }
  });
  return {dq.view({x.B, x.heads, x.c, x.hd}), dk.view({x.B, x.kv_heads, x.n, x.hd}),
          dv.view({x.B, x.kv_heads, x.n, x.hd})};
}

}  // namespace

const AttentionKernel& cpu_bf16_attention_kernel() {
  static const AttentionKernel kernel{"cpu bf16 blocks (oneDNN)", false, true, bf16_forward, bf16_backward, true};
  return kernel;
}

ScopedBf16AttentionRowTile::ScopedBf16AttentionRowTile(std::int64_t rows) : previous_(row_tile_override) {
  row_tile_override = rows;
}
ScopedBf16AttentionRowTile::~ScopedBf16AttentionRowTile() { row_tile_override = previous_; }

std::int64_t cpu_bf16_attention_backward_scratch_bytes(std::int64_t matrices, std::int64_t rows, std::int64_t keys,
                                                       std::int64_t head_dim, bool causal, double scale,
                                                       std::int64_t threads) {
  Operands x{};
  x.rows = rows, x.n = keys, x.hd = head_dim, x.c = keys;  // a causal block is square
  return workers(matrices, threads) * (tile_rows(rows) * keys * (4 + 4 + 2) + pad_bytes(x, float(scale), true, causal));
}

bool cpu_bf16_attention_available() { return onednn::bf16_native() && softmax_rows_supported(); }

}  // namespace sbp
