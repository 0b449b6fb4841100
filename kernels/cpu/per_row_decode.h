// The paged decode attention's per-row tasks (paged_decode_attention.cpp): query heads of one
// KV head of one sequence over a span of its context, read through its block table. In bf16 with
// head_dim 64, bf16 dot products on the raw rows with prefetching; else a portable float path.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "decode_attention_parts.h"
#include "vector_math.h"

namespace splitserve_cpu {
// Internal linkage, as if written in the .cpp that includes this: the hot loops inline it.
namespace {

inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t widened = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(dst + i, &widened, sizeof(float));
  }
}

inline void to_float(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}


inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0.0f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  float sum = 0.0f;
  for (int j = 0; j < kLanes; ++j) sum += acc[j];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

#ifdef __AVX512F__
// 16 values widened to float: the hot loops below hold a 64-wide head in four registers.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

#define SPLITSERVE_DECODE_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// r[i] = the sum of a[i]'s 16 lanes, for 16 vectors at once: halves, quarters, then pairs and
// fours within 128-bit lanes are added across vectors (46 instructions for 16 sums, where a
// horizontal reduction apiece costs about 8 each and a chain of dependent shuffles).
SPLITSERVE_DECODE_BF16 inline __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4];
  for (int j = 0; j < 8; ++j)  // lanes 0-1: a[2j]'s partial sums, lanes 2-3: a[2j + 1]'s
    b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xEE));
  for (int k = 0; k < 4; ++k)  // 128-bit lane L: four partial sums of a[4k + L]
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0xDD));
  const __m512 d0 = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
  const __m512 d1 = _mm512_add_ps(_mm512_unpacklo_ps(c[2], c[3]), _mm512_unpackhi_ps(c[2], c[3]));
  // Lane L, element m: the sum of a[4m + L]; the permutation puts it at 4m + L.
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d0, d1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(d0, d1, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, e);
}

// Prefetches the K row (into L1) and the V row (into L2, read after all scores) of the context
// tokens a cursor yields: the rows of one KV head are 128 bytes every kv_heads * 128, a stride
// the hardware prefetchers follow poorly (a batch-64 layer read 12.8 GB/s of a ~27 without).
SPLITSERVE_DECODE_BF16 inline void prefetch_rows(TokenRows<c10::BFloat16>& rows,
                                                 const c10::BFloat16* k_data,
                                                 const c10::BFloat16* v_data) {
  const c10::BFloat16* k = rows.next();
  const c10::BFloat16* v = v_data + (k - k_data);
  _mm_prefetch(reinterpret_cast<const char*>(k), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(k + 32), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(v), _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(v + 32), _MM_HINT_T1);
}

// Tokens ahead of the one being scored whose rows are prefetched.
constexpr int64_t kPrefetchTokens = 32;

// Scores of kGroup query heads (bf16 rows of 64, unscaled) over context tokens [t0, t1) of
// bf16 keys, times `scale`, into scores [kGroup, t1 - t0]: bf16 dot products (vdpbf16ps, two
// per key row, no widening), summed 16 tokens at a time by reduce16. The first head's pass
// prefetches the K and V rows kPrefetchTokens ahead.
template <int kGroup>
SPLITSERVE_DECODE_BF16 void scores_bf16_d64(const c10::BFloat16* const* q_rows,
                                            const c10::BFloat16* k_data, const c10::BFloat16* v_data,
                                            const int64_t* table,
                                            int64_t t0, int64_t t1, int64_t block_size,
                                            int64_t block_stride, int64_t token_stride,
                                            int64_t head_offset, float scale, float* scores) {
  const int64_t len = t1 - t0;
  const __m512 scale_v = _mm512_set1_ps(scale);
  TokenRows<c10::BFloat16> ahead(k_data, table, t0, block_size, block_stride, token_stride, head_offset);
  int64_t fetched = t0;  // rows of tokens before this one are prefetched
  for (; fetched < std::min(t0 + kPrefetchTokens, t1); ++fetched) prefetch_rows(ahead, k_data, v_data);
  for (int g = 0; g < kGroup; ++g) {
    TokenRows<c10::BFloat16> keys(k_data, table, t0, block_size, block_stride, token_stride, head_offset);
    const __m512bh q0 = (__m512bh)_mm512_loadu_si512(q_rows[g]);
    const __m512bh q1 = (__m512bh)_mm512_loadu_si512(q_rows[g] + 32);
    float* out = scores + g * len;
    int64_t t = t0;
    __m512 acc[16];
    for (; t + 16 <= t1; t += 16) {
      for (int i = 0; i < 16; ++i) {
        if (fetched < t1) {
          prefetch_rows(ahead, k_data, v_data);
          ++fetched;
        }
        const c10::BFloat16* k = keys.next();
        acc[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), q0, (__m512bh)_mm512_loadu_si512(k));
        acc[i] = _mm512_dpbf16_ps(acc[i], q1, (__m512bh)_mm512_loadu_si512(k + 32));
      }
      _mm512_storeu_ps(out + (t - t0), _mm512_mul_ps(reduce16(acc), scale_v));
    }
    for (; t < t1; ++t) {
      const c10::BFloat16* k = keys.next();
      __m512 one = _mm512_dpbf16_ps(_mm512_setzero_ps(), q0, (__m512bh)_mm512_loadu_si512(k));
      one = _mm512_dpbf16_ps(one, q1, (__m512bh)_mm512_loadu_si512(k + 32));
      out[t - t0] = _mm512_reduce_add_ps(one) * scale;
    }
  }
}

// The head_dim == 64 case (SmolLM2, Llama 3.2 1B uses 64 too): q, the accumulators and one
// K/V row in registers, scores written once, K and V each read once.
// `scored`: the scores are in `scores` already (scores_bf16_d64).
template <typename scalar_t, int kGroup>
void decode_task_d64(const float* q /* [kGroup, 64], scaled */, const scalar_t* k_data,
                     const scalar_t* v_data, const int64_t* table, int64_t t0, int64_t t1,
                     int64_t block_size, int64_t block_stride, int64_t token_stride,
                     int64_t head_offset, float* scores, Partial part, bool scored = false) {
  const int64_t len = t1 - t0;
  __m512 qv[kGroup][4];
  for (int g = 0; g < kGroup; ++g)
    for (int c = 0; c < 4; ++c) qv[g][c] = _mm512_loadu_ps(q + g * 64 + c * 16);
  TokenRows<scalar_t> keys(k_data, table, t0, block_size, block_stride, token_stride, head_offset);
  for (int64_t t = scored ? t1 : t0; t < t1; ++t) {
    const scalar_t* k = keys.next();
    __m512 kv[4];
    for (int c = 0; c < 4; ++c) kv[c] = load16(k + c * 16);
    for (int g = 0; g < kGroup; ++g) {
      __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
      for (int c = 1; c < 4; ++c) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
      scores[g * len + t - t0] = _mm512_reduce_add_ps(acc);
    }
  }
  exp_scores(scores, kGroup, len, part);
  __m512 acc[kGroup][4];
  for (int g = 0; g < kGroup; ++g)
    for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
  TokenRows<scalar_t> values(v_data, table, t0, block_size, block_stride, token_stride, head_offset);
  for (int64_t t = t0; t < t1; ++t) {
    const scalar_t* v = values.next();
    __m512 vv[4];
    for (int c = 0; c < 4; ++c) vv[c] = load16(v + c * 16);
    for (int g = 0; g < kGroup; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * len + t - t0]);
      for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < kGroup; ++g)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(part.acc + g * 64 + c * 16, acc[g][c]);
}
#endif

// Any head_dim and group: token by token through a float row.
template <typename scalar_t>
void decode_task_generic(const float* q, const scalar_t* k_data, const scalar_t* v_data,
                         const int64_t* table, int64_t t0, int64_t t1, int64_t group, int64_t dim,
                         int64_t block_size, int64_t block_stride, int64_t token_stride,
                         int64_t head_offset, float* scores, float* row, Partial part) {
  const int64_t len = t1 - t0;
  TokenRows<scalar_t> keys(k_data, table, t0, block_size, block_stride, token_stride, head_offset);
  for (int64_t t = t0; t < t1; ++t) {
    to_float(keys.next(), row, dim);
    for (int64_t g = 0; g < group; ++g) scores[g * len + t - t0] = dot(q + g * dim, row, dim);
  }
  exp_scores(scores, group, len, part);
  std::fill(part.acc, part.acc + group * dim, 0.0f);
  TokenRows<scalar_t> values(v_data, table, t0, block_size, block_stride, token_stride, head_offset);
  for (int64_t t = t0; t < t1; ++t) {
    to_float(values.next(), row, dim);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * len + t - t0];
      float* a = part.acc + g * dim;
      for (int64_t d = 0; d < dim; ++d) a[d] += p * row[d];
    }
  }
}

// Query heads [group] of one KV head over tokens [t0, t1) of row b: the bf16 kernels when the
// CPU has them, else the portable one.
template <typename scalar_t>
void attend_group(const scalar_t* q_data, int64_t q_stride_b, int64_t q_stride_h, int64_t b,
                  int64_t kvh, int64_t group, int64_t dim, double scale, const scalar_t* k_data,
                  const scalar_t* v_data, const int64_t* table, int64_t t0, int64_t t1,
                  int64_t block_size, int64_t block_stride, int64_t token_stride,
                  std::vector<float>& q, std::vector<float>& row, std::vector<float>& scores,
                  Partial part) {
  scores.resize(group * (t1 - t0));
  for (int64_t g = 0; g < group; ++g) {
    to_float(q_data + b * q_stride_b + (kvh * group + g) * q_stride_h, q.data() + g * dim, dim);
    for (int64_t d = 0; d < dim; ++d) q[g * dim + d] *= static_cast<float>(scale);
  }
  const int64_t offset = kvh * dim;
#ifdef __AVX512F__
  if (dim == 64 && group >= 1 && group <= 4) {
    bool scored = false;
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      if (splitserve_cpu::has_avx512_bf16()) {  // bf16 dot products on the raw rows; scaled after
        const c10::BFloat16* q_rows[4];
        for (int64_t g = 0; g < group; ++g)
          q_rows[g] = q_data + b * q_stride_b + (kvh * group + g) * q_stride_h;
        switch (group) {
          case 1: scores_bf16_d64<1>(q_rows, k_data, v_data, table, t0, t1, block_size, block_stride, token_stride, offset, static_cast<float>(scale), scores.data()); break;
          case 2: scores_bf16_d64<2>(q_rows, k_data, v_data, table, t0, t1, block_size, block_stride, token_stride, offset, static_cast<float>(scale), scores.data()); break;
          case 3: scores_bf16_d64<3>(q_rows, k_data, v_data, table, t0, t1, block_size, block_stride, token_stride, offset, static_cast<float>(scale), scores.data()); break;
          default: scores_bf16_d64<4>(q_rows, k_data, v_data, table, t0, t1, block_size, block_stride, token_stride, offset, static_cast<float>(scale), scores.data()); break;
        }
        scored = true;
      }
    }
    switch (group) {
      case 1: decode_task_d64<scalar_t, 1>(q.data(), k_data, v_data, table, t0, t1, block_size, block_stride, token_stride, offset, scores.data(), part, scored); break;
      case 2: decode_task_d64<scalar_t, 2>(q.data(), k_data, v_data, table, t0, t1, block_size, block_stride, token_stride, offset, scores.data(), part, scored); break;
      case 3: decode_task_d64<scalar_t, 3>(q.data(), k_data, v_data, table, t0, t1, block_size, block_stride, token_stride, offset, scores.data(), part, scored); break;
      default: decode_task_d64<scalar_t, 4>(q.data(), k_data, v_data, table, t0, t1, block_size, block_stride, token_stride, offset, scores.data(), part, scored); break;
    }
    return;
  }
#endif
  decode_task_generic<scalar_t>(q.data(), k_data, v_data, table, t0, t1, group, dim, block_size,
                                block_stride, token_stride, offset, scores.data(), row.data(), part);
}

}  // namespace
}  // namespace splitserve_cpu
