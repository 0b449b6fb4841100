// Decode attention over a prefix that several sequences share (cascade attention): their query
// heads attend the prefix's K/V rows together, each row read once for all of them, as two small
// matrix products in bf16 (vdpbf16ps), instead of once per sequence at 2 bf16 dot products and
// a reduction per score. paged_decode_attention.cpp combines the result with each sequence's
// own tokens after the prefix. Measured by bench/decode_attention.py --shared-prefix.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "decode_attention_parts.h"
#include "vector_math.h"

namespace splitserve_cpu {
// Internal linkage, as if written in the .cpp that includes this: the hot loops inline it.
namespace {

// Context tokens of a shared prefix per task: its scores stay in L2 (128 tokens x 96 rows x 4
// bytes is 48 KB), and its K/V rows (32 KB) in L1 while every row block reads them.
constexpr int64_t kSharedChunkTokens = 128;

// What one thread's shared-prefix tasks reuse between tasks.
struct SharedScratch {
  std::vector<uint32_t> q_pairs;  // [row blocks][32 dwords][16 rows]: q transposed
  std::vector<float> scores;      // [tokens][padded rows]: scores, transposed, then exp
  std::vector<uint32_t> p_pairs;  // [token pairs][padded rows]: two tokens' weights in bf16
  std::vector<float> max, sum;    // [padded rows]
  std::vector<const c10::BFloat16*> k_rows, v_rows;  // [tokens]: each token's K and V row
  std::vector<uint32_t> v_pairs;  // [token pairs][4 registers][16 dwords]: V interleaved
  std::vector<float> acc;         // [padded rows][64]: P.V in unpack order
};

#ifdef __AVX512F__
#define SPLITSERVE_SHARED_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// acc[r][c] += the weights of row r0 + r times V for every token pair: v_pairs holds, per pair
// (t, t + 1), four registers of (V[t][d], V[t + 1][d]) bf16 pairs, and p_pairs the matching
// (P[t][r], P[t + 1][r]) pair of each row, so one vdpbf16ps adds two tokens' weighted rows.
// The dims come out in unpack order (see shared_prefix_task_bf16_d64).
template <int kRows>
SPLITSERVE_SHARED_BF16 void weighted_values(const uint32_t* p_pairs, int64_t padded_rows,
                                            int64_t r0, const uint32_t* v_pairs, int64_t pairs,
                                            float* acc_out) {
  __m512 acc[kRows][4];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t tp = 0; tp < pairs; ++tp) {
    __m512bh v[4];
    for (int c = 0; c < 4; ++c) v[c] = (__m512bh)_mm512_loadu_si512(v_pairs + (tp * 4 + c) * 16);
    const uint32_t* p = p_pairs + tp * padded_rows + r0;
    for (int r = 0; r < kRows; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[r]));
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w, v[c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc_out + (r0 + r) * 64 + c * 16, acc[r][c]);
}

// Query rows q_rows[0..rows) (bf16 rows of 64, unscaled) of one KV head over its context
// tokens [t0, t1) through `table`: part.max / sum / acc of each row, as decode_task_d64 leaves
// them for its group.
//   scores: q is transposed once (dword j of 16 rows per register) and every key row's dword j
//     broadcast against it, so 16 rows' scores of a token come out of 32 vdpbf16ps with no
//     reduction, 8 tokens at a time;
//   softmax: down the token axis, 16 rows per register;
//   P.V: the weights rounded to bf16 (as flash attention's P.V product on GPUs does; the sums
//     stay float32) and two tokens per vdpbf16ps.
SPLITSERVE_SHARED_BF16 inline void shared_prefix_task_bf16_d64(
    const c10::BFloat16* const* q_rows, int64_t rows, const c10::BFloat16* k_data,
    const c10::BFloat16* v_data, const int64_t* table, int64_t t0, int64_t t1, int64_t block_size,
    int64_t block_stride, int64_t token_stride, int64_t head_offset, float scale,
    SharedScratch& s, Partial part) {
  constexpr int kTokens = 8;  // tokens scored at once: 8 accumulators per row block
  static const uint16_t zero_row[64] = {};
  const auto* zero = reinterpret_cast<const c10::BFloat16*>(zero_row);
  const int64_t len = t1 - t0;
  const int64_t padded_rows = (rows + 15) / 16 * 16, row_blocks = padded_rows / 16;
  const int64_t padded_len = (len + kTokens - 1) / kTokens * kTokens;  // even, too

  s.q_pairs.assign(row_blocks * 32 * 16, 0);
  for (int64_t r = 0; r < rows; ++r) {
    uint32_t q[32];
    std::memcpy(q, q_rows[r], sizeof(q));
    for (int j = 0; j < 32; ++j) s.q_pairs[((r / 16) * 32 + j) * 16 + r % 16] = q[j];
  }
  s.k_rows.resize(padded_len);
  s.v_rows.resize(padded_len);
  TokenRows<c10::BFloat16> keys(k_data, table, t0, block_size, block_stride, token_stride, head_offset);
  for (int64_t t = 0; t < padded_len; ++t) {
    s.k_rows[t] = t < len ? keys.next() : zero;
    s.v_rows[t] = t < len ? v_data + (s.k_rows[t] - k_data) : zero;
    _mm_prefetch(reinterpret_cast<const char*>(s.v_rows[t]), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(s.v_rows[t] + 32), _MM_HINT_T1);
  }

  s.scores.resize(padded_len * padded_rows);
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    const __m512i* qp = reinterpret_cast<const __m512i*>(s.q_pairs.data() + rb * 32 * 16);
    for (int64_t t = 0; t < padded_len; t += kTokens) {
      if (rb == 0)
        for (int i = 0; i < kTokens && t + 2 * kTokens + i < len; ++i) {
          const char* ahead = reinterpret_cast<const char*>(s.k_rows[t + 2 * kTokens + i]);
          _mm_prefetch(ahead, _MM_HINT_T0);
          _mm_prefetch(ahead + 64, _MM_HINT_T0);
        }
      const uint32_t* k[kTokens];
      for (int i = 0; i < kTokens; ++i) k[i] = reinterpret_cast<const uint32_t*>(s.k_rows[t + i]);
      __m512 acc[kTokens];
      for (int i = 0; i < kTokens; ++i) acc[i] = _mm512_setzero_ps();
      for (int j = 0; j < 32; ++j) {
        const __m512bh q = (__m512bh)_mm512_loadu_si512(qp + j);
        for (int i = 0; i < kTokens; ++i)
          acc[i] = _mm512_dpbf16_ps(acc[i], q, (__m512bh)_mm512_set1_epi32(static_cast<int>(k[i][j])));
      }
      for (int i = 0; i < kTokens; ++i)
        _mm512_storeu_ps(s.scores.data() + (t + i) * padded_rows + rb * 16, _mm512_mul_ps(acc[i], scale_v));
    }
  }

  // Softmax down the tokens, every row at once (the loops over rows vectorize).
  s.max.assign(padded_rows, -std::numeric_limits<float>::infinity());
  s.sum.assign(padded_rows, 0.0f);
  float* mx = s.max.data();
  float* sm = s.sum.data();
  for (int64_t t = 0; t < len; ++t) {
    const float* row = s.scores.data() + t * padded_rows;
    for (int64_t r = 0; r < padded_rows; ++r) mx[r] = std::max(mx[r], row[r]);
  }
  for (int64_t t = 0; t < len; ++t) {
    float* row = s.scores.data() + t * padded_rows;
    for (int64_t r = 0; r < padded_rows; ++r) {
      row[r] = exp_nonpositive(row[r] - mx[r]);
      sm[r] += row[r];
    }
  }
  std::fill(s.scores.begin() + len * padded_rows, s.scores.end(), 0.0f);  // padding weighs 0

  const int64_t pairs = padded_len / 2;
  s.p_pairs.resize(pairs * padded_rows);
  for (int64_t tp = 0; tp < pairs; ++tp)
    for (int64_t rb = 0; rb < row_blocks; ++rb) {
      const float* even = s.scores.data() + 2 * tp * padded_rows + rb * 16;
      const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(even)));
      const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(even + padded_rows)));
      _mm512_storeu_si512(s.p_pairs.data() + tp * padded_rows + rb * 16,
                          _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }

  // V rows of token pairs, interleaved: 4 registers per pair, 2 KB per 16 tokens. Within each
  // 128-bit lane the unpacks take dims 8L..8L+3 (lo) and 8L+4..8L+7 (hi) of their 32.
  s.v_pairs.resize(pairs * 4 * 16);
  for (int64_t tp = 0; tp < pairs; ++tp) {
    const c10::BFloat16* a = s.v_rows[2 * tp];
    const c10::BFloat16* b = s.v_rows[2 * tp + 1];
    for (int half = 0; half < 2; ++half) {
      const __m512i va = _mm512_loadu_si512(a + 32 * half), vb = _mm512_loadu_si512(b + 32 * half);
      _mm512_storeu_si512(s.v_pairs.data() + (tp * 4 + 2 * half) * 16, _mm512_unpacklo_epi16(va, vb));
      _mm512_storeu_si512(s.v_pairs.data() + (tp * 4 + 2 * half + 1) * 16, _mm512_unpackhi_epi16(va, vb));
    }
  }
  s.acc.resize(padded_rows * 64);
  const uint32_t* v_pairs = s.v_pairs.data();
  float* acc = s.acc.data();
  constexpr int kRows = 6;  // 24 accumulators and 4 V registers
  int64_t r0 = 0;
  for (; r0 + kRows <= rows; r0 += kRows)
    weighted_values<kRows>(s.p_pairs.data(), padded_rows, r0, v_pairs, pairs, acc);
  switch (rows - r0) {
    case 1: weighted_values<1>(s.p_pairs.data(), padded_rows, r0, v_pairs, pairs, acc); break;
    case 2: weighted_values<2>(s.p_pairs.data(), padded_rows, r0, v_pairs, pairs, acc); break;
    case 3: weighted_values<3>(s.p_pairs.data(), padded_rows, r0, v_pairs, pairs, acc); break;
    case 4: weighted_values<4>(s.p_pairs.data(), padded_rows, r0, v_pairs, pairs, acc); break;
    case 5: weighted_values<5>(s.p_pairs.data(), padded_rows, r0, v_pairs, pairs, acc); break;
    default: break;
  }
  for (int64_t r = 0; r < rows; ++r) {
    part.max[r] = mx[r];
    part.sum[r] = sm[r];
    const float* in = acc + r * 64;
    float* out = part.acc + r * 64;
    for (int c = 0; c < 4; ++c)  // register c, lane e: dim 32 (c / 2) + 8 (e / 4) + 4 (c % 2) + e % 4
      for (int e = 0; e < 16; ++e) out[32 * (c / 2) + 8 * (e / 4) + 4 * (c % 2) + e % 4] = in[c * 16 + e];
  }
}
#endif

}  // namespace
}  // namespace splitserve_cpu
