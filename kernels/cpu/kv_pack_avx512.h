// Packing keys and values for the prefill attention kernels (prefill_attention.cpp's dot
// products, prefill_attention_amx.cpp's tiles), 16 keys at a time with AVX-512: the two
// layouts differ in where a vector goes, not in how it is read.
#pragma once

#include <immintrin.h>

#include <cstdint>

#define SPLITSERVE_PACK_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

namespace splitserve_cpu::kv_pack {

// One (d, d + 1) pair of 16 keys `stride` 32-bit words apart, key j's to lane j (keys past
// `present` as zeros): first points at pair 0 of the first key's row.
SPLITSERVE_PACK_TARGET inline __m512i gather_pairs(const int32_t* first, int32_t stride, __mmask16 present,
                                                   int64_t pair) {
  const __m512i at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                        _mm512_set1_epi32(stride));
  return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), present, at, first + pair, 4);
}

// Two keys' value rows of D bf16 (nullptr: zeros) as [D][2] at dst: dim d of a, then of b.
SPLITSERVE_PACK_TARGET inline void interleave_pair(const uint16_t* a, const uint16_t* b, uint16_t* dst,
                                                   int64_t D) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t d = 0; d < D; d += 16) {
    const __m256i x = a ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d)) : _mm256_setzero_si256();
    const __m256i y = b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + d)) : _mm256_setzero_si256();
    _mm512_storeu_si512(dst + d * 2,
                        _mm512_permutexvar_epi16(interleave, _mm512_inserti64x4(_mm512_castsi256_si512(x), y, 1)));
  }
}

}  // namespace splitserve_cpu::kv_pack
