#include "core/model/softmax_rows.h"

#include <immintrin.h>

#include <cmath>
#include <limits>

#include <ATen/Parallel.h>

// Only these functions are compiled for AVX-512 (per function, never the file: inline functions of headers compiled
// with a wider ISA could be kept by the linker for every caller). They run only on CPUs that have it.
#define SBP_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

namespace sbp {
namespace {

// exp(x) for 16 floats, x <= ~88: x = n ln2 + r with |r| <= ln2/2, exp(r) by its Taylor series to degree 7 (the
// remainder is below 6e-9 relative, a tenth of an fp32 ulp), times 2^n by scalef (0 for n below fp32's range).
SBP_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln2 in two parts, so that n ln2 is subtracted without rounding for |n| < 2^10.
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// fp32 -> bf16 bits, rounded to nearest even (the inputs here are finite).
SBP_AVX512 inline __m256i to_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

SBP_AVX512 inline __mmask16 tail(std::int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

SBP_AVX512 void forward_row(float* s, std::int64_t keys, std::int64_t visible, float* lse, std::uint16_t* p) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  __m512 m = _mm512_set1_ps(minus_inf);
  for (std::int64_t j = 0; j < visible; j += 16)
    m = _mm512_max_ps(m, _mm512_mask_loadu_ps(_mm512_set1_ps(minus_inf), tail(visible - j), s + j));
  const float row_max = _mm512_reduce_max_ps(m);
  const __m512 vmax = _mm512_set1_ps(row_max);
  __m512 sum = _mm512_setzero_ps();
  for (std::int64_t j = 0; j < visible; j += 16) {
    const auto k = tail(visible - j);
    const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), vmax)));
    _mm512_mask_storeu_ps(s + j, k, e);
    sum = _mm512_add_ps(sum, e);
  }
  const float total = _mm512_reduce_add_ps(sum);
  *lse = row_max + std::log(total);
  const __m512 inv = _mm512_set1_ps(1.0f / total);
  for (std::int64_t j = 0; j < keys; j += 16) {
    const auto k = tail(keys - j);
    const auto seen = j < visible ? tail(visible - j) : __mmask16(0);
    const __m512 q = _mm512_maskz_mul_ps(seen, _mm512_maskz_loadu_ps(seen, s + j), inv);
    _mm256_mask_storeu_epi16(p + j, k, to_bf16(q));
  }
}

SBP_AVX512 void recompute_row(float* s, std::int64_t keys, std::int64_t visible, float lse, std::uint16_t* p) {
  const __m512 vlse = _mm512_set1_ps(lse);
  for (std::int64_t j = 0; j < keys; j += 16) {
    const auto k = tail(keys - j);
    const auto seen = j < visible ? tail(visible - j) : __mmask16(0);
    const __m512 e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(seen, s + j), vlse)));
    _mm512_mask_storeu_ps(s + j, k, e);
    _mm256_mask_storeu_epi16(p + j, k, to_bf16(e));
  }
}

SBP_AVX512 void gradient_row(const float* p, const float* dp, std::int64_t keys, float d, std::uint16_t* ds) {
  const __m512 vd = _mm512_set1_ps(d);
  for (std::int64_t j = 0; j < keys; j += 16) {
    const auto k = tail(keys - j);
    const __m512 g = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, p + j), _mm512_sub_ps(_mm512_maskz_loadu_ps(k, dp + j), vd));
    _mm256_mask_storeu_epi16(ds + j, k, to_bf16(g));
  }
}

// The rows in parallel, a few per task (a row is ~1k keys). Inside the kernel's own workers this runs inline; it
// splits the rows when the kernel has a single task (one K/V head's matrix).
template <class F>
void for_rows(const ScoreRows& shape, const F& f) {
  at::parallel_for(0, shape.rows, 8, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) f(r);
  });
}

}  // namespace

bool softmax_rows_supported() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"); }

void softmax_rows_forward(const ScoreRows& shape, float* s, float* lse, std::uint16_t* p) {
  const auto n = shape.keys;
  for_rows(shape, [&](std::int64_t r) { forward_row(s + r * n, n, shape.visible(r), lse + r, p + r * n); });
}

void probabilities_from_lse(const ScoreRows& shape, float* s, const float* lse, std::uint16_t* p) {
  const auto n = shape.keys;
  for_rows(shape, [&](std::int64_t r) { recompute_row(s + r * n, n, shape.visible(r), lse[r], p + r * n); });
}

void score_gradient_rows(const ScoreRows& shape, const float* p, const float* dp, const float* d, std::uint16_t* ds) {
  const auto n = shape.keys;
  for_rows(shape, [&](std::int64_t r) { gradient_row(p + r * n, dp + r * n, n, d[r], ds + r * n); });
}

}  // namespace sbp

#undef SBP_AVX512  // unity builds: the next file of the batch must not see it
