// The row-wise steps of the CPU's bf16 block attention (chunk_attention_bf16.cpp) between its oneDNN products: one
// pass per row over the block's fp32 scores, in AVX-512 (the kernel runs only where oneDNN has native bf16 kernels,
// hence on CPUs with AVX512-BF16 or AMX).
//
// A block of scores is `rows` x `keys` fp32, row stride `keys`; its per-row vectors (lse, D) are `rows` long. Row r is
// the query (first_row + r) mod period of the block when the block is causal (period > 0): it sees keys 0..that
// query, the others are masked. Every row sees all keys when period == 0. Probabilities are written as bf16 bits
// rounded to nearest even, as c10::BFloat16 rounds.
#pragma once

#include <cstdint>

namespace sbp {

struct ScoreRows {
  std::int64_t rows = 0, keys = 0;
  std::int64_t first_row = 0, period = 0;  // causal rule; period 0: none
  std::int64_t visible(std::int64_t r) const { return period > 0 ? (first_row + r) % period + 1 : keys; }
};

// Forward: per row, softmax over its visible scores s -> p (bf16; 0 where masked) and its log-sum-exp lse[r]. s is
// overwritten.
void softmax_rows_forward(const ScoreRows& shape, float* s, float* lse, std::uint16_t* p);
// Backward: p = exp(s - lse) per row, the whole softmax's probabilities (0 where masked), in place into s and as bf16.
void probabilities_from_lse(const ScoreRows& shape, float* s, const float* lse, std::uint16_t* p);
// Backward: dS = P (dP - D) per row (D[r]: rowsum(dO * O)), as bf16.
void score_gradient_rows(const ScoreRows& shape, const float* p, const float* dp, const float* d, std::uint16_t* ds);
// Whether this process can run them (the CPU has AVX-512 F and BW).
bool softmax_rows_supported();

}  // namespace sbp
