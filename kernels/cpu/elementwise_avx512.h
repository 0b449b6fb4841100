// Two element-wise steps of a decoder layer (fused_decode.cpp: the RMS norm with its residual
// add, the rotary embedding with its cache write) written with AVX-512 intrinsics, for CPUs
// with AVX-512 BF16 (chosen at run time; the portable loops stay the fallback).
//
// Why: the portable loops leave the vectorizing to the compiler, and every bf16 rounding there
// is c10's integer emulation. A 2,048-token prompt step of SmolLM2 spent 35 ms in the rotary
// embedding and 26 ms in the norms (`python bench/prefill.py --threads 2 --lengths 2048 --only
// profile`); what this gained end to end: `python bench/prefill_against_revision.py` (README,
// Engine).
// SiLU-and-multiply came later: the portable loop's two float divisions per element (vdivps,
// one per 16 cycles) bound it at 0.6 ns an element on one core; here one reciprocal estimate
// and a Newton step replace both.
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

// exp(x) for x <= 0, 16 at a time: vector_math.h's exp_nonpositive, step for step (2^n by
// vscalefps, exact where its exponent bits are: n >= -126 after the clamp). Also the softmax's
// of the dot-product prefill attention (prefill_attention.cpp).
SPLITSERVE_BF16_TARGET inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// One row of silu_and_mul (fused_decode.cpp): out = bf16(bf16(silu(g)) * u). silu(g) = g *
// sigmoid(g) with e = exp(-|g|) (squared from half the argument, so that it reaches below
// float's normal range): sigmoid = 1 / (1 + e) for g >= 0, e / (1 + e) below, the reciprocal
// from vrcp14ps and one Newton step, the quotient corrected once by its residual (so it is
// torch's g / (1 + exp(-g)) but where the two exps differ in their last bit; the bf16 results
// differ now and then at a rounding boundary). Where torch's exp(-g) overflows
// (g < -88.72) the result is -0, as torch's.
SPLITSERVE_BF16_TARGET inline void silu_and_mul_row(const bf16* gate, const bf16* up, bf16* out, int64_t size) {
  const __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f);
  for (int64_t i = 0; i < size; i += 16) {
    const __mmask16 m = first_lanes(size - i);
    const __m512 g = load(gate + i, m);
    const __m512 half = exp_nonpositive(_mm512_mul_ps(_mm512_abs_ps(g), _mm512_set1_ps(-0.5f)));
    const __m512 e = _mm512_mul_ps(half, half);
    const __m512 d = _mm512_add_ps(one, e);
    __m512 r = _mm512_rcp14_ps(d);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, two));  // r (2 - d r)
    // The quotient n / d with n = g (g >= 0) or g e (below), then one correction by its
    // residual (an FMA): the quotient rounded as a division would round it, all but always.
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 n = _mm512_mask_mul_ps(g, negative, g, e);
    const __m512 q = _mm512_mul_ps(n, r);
    __m512 silu = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, d, n), r, q);
    // Below -88.72, torch's exp(-g) is inf and its quotient -0.
    const __mmask16 overflows = _mm512_cmp_ps_mask(g, _mm512_set1_ps(-88.7228394f), _CMP_LT_OQ);
    silu = _mm512_mask_mov_ps(silu, overflows, _mm512_set1_ps(-0.0f));
    store(out + i, _mm512_mul_ps(round(silu), load(up + i, m)), m);
  }
}

}  // namespace splitserve_cpu::avx512
