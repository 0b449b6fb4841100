// Two element-wise steps of a decoder layer (fused_decode.cpp: the RMS norm with its residual
// add, the rotary embedding with its cache write) written with AVX-512 intrinsics, for CPUs
// with AVX-512 BF16 (chosen at run time; the portable loops stay the fallback).
//
// Why: the portable loops leave the vectorizing to the compiler, and every bf16 rounding there
// is c10's integer emulation. A 2,048-token prompt step of SmolLM2 spent 35 ms in the rotary
// embedding and 26 ms in the norms (`python bench/prefill.py --threads 2 --lengths 2048 --only
// profile`); what this gained end to end: `python bench/prefill_against_revision.py` (README,
// Engine).
// (SiLU-and-multiply was tried too and kept portable: it is bound by its exp either way, 0.6 ns
// an element on one core with its data in L2, vectorized by the compiler or by hand.)
//
// Rounding: every step rounds to bf16 where the portable loop does, with vcvtneps2bf16 (round
// to nearest even, as c10 rounds), and the RMS sum of squares is added in the portable loop's
// order (16 partial sums, then those in turn), so results equal the portable loop's. One
// difference: the instruction flushes float denormals (below 1.2e-38) to zero where c10 keeps
// them.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#define SPLITSERVE_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace splitserve_cpu::avx512 {

using bf16 = c10::BFloat16;

// Lanes [0, n) of 16.
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

SPLITSERVE_BF16_TARGET inline __m512 load(const bf16* p, __mmask16 m = 0xFFFF) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

SPLITSERVE_BF16_TARGET inline __m256i to_bf16(__m512 v) {
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
}

SPLITSERVE_BF16_TARGET inline void store(bf16* p, __m512 v, __mmask16 m = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, m, to_bf16(v));
}

// float(bf16(v)): v rounded to bf16 and widened back.
SPLITSERVE_BF16_TARGET inline __m512 round(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

// One row of add_rms_norm (fused_decode.cpp): sum = bf16(h_in + res_in) (or h_in), res <- sum,
// h <- bf16(w * bf16(sum * inv_rms)); the outputs may be the inputs. x: `size` floats of scratch.
SPLITSERVE_BF16_TARGET inline void rms_norm_row(const bf16* h_in, const bf16* res_in, bf16* h, bf16* res,
                                                const bf16* w, int64_t size, float eps, bool add_residual,
                                                float* x) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < size; i += 16) {
    const __mmask16 m = first_lanes(size - i);
    __m512 sum = load(h_in + i, m);
    if (add_residual) sum = round(_mm512_add_ps(sum, load(res_in + i, m)));
    store(res + i, sum, m);
    _mm512_mask_storeu_ps(x + i, m, sum);
    squares = _mm512_fmadd_ps(sum, sum, squares);  // masked-off lanes loaded as 0
  }
  // The lanes added in order, as the portable loop adds its 16 partial sums.
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, squares);
  float total = 0.0f;
  for (int j = 0; j < 16; ++j) total += lanes[j];
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(total / static_cast<float>(size) + eps));
  for (int64_t i = 0; i < size; i += 16) {
    const __mmask16 m = first_lanes(size - i);
    const __m512 normed = round(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), inv));
    store(h + i, _mm512_mul_ps(load(w + i, m), normed), m);
  }
}

// One head of rotate_and_store's rotation (rotate-half layout): out = bf16(bf16(x * c) +
// bf16(swap_halves(x) * s)). dim a multiple of 32, so each half is whole vectors.
SPLITSERVE_BF16_TARGET inline void rotate_head(const bf16* x, const bf16* c, const bf16* s, bf16* out, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < dim; i += 16) {
    const __m512 swapped = load(x + (i < half ? i + half : i - half));
    const __m512 a = round(_mm512_mul_ps(load(x + i), load(c + i)));
    const __m512 b = round(_mm512_mul_ps(swapped, load(s + i)));
    store(out + i, _mm512_add_ps(a, b));
  }
}

}  // namespace splitserve_cpu::avx512
