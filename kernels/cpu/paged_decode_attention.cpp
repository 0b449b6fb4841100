// Paged decode attention on CPU: one query token per sequence, K and V read once, in place,
// from the paged cache (no gather into a padded copy), float32 accumulation.
// Reference and oracle: kernels/attention.py paged_decode_attention.
//
// query [B, heads, D]; k_cache/v_cache [blocks, block_size, kv_heads, D] (contiguous);
// block_tables [B, >= cdiv(len, block_size)] int64; seq_lens [B] int64 -> [B, heads, D].
// window > 0 (a sliding-window layer): each query reads only the last `window` tokens of its
// context; those before are never touched.
// Query head h reads KV head h / (heads / kv_heads), as transformers' repeat_kv does.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "vector_math.h"

namespace {

using splitserve_cpu::exp_nonpositive;

constexpr int kLanes = 16;  // partial sums per dot product: one AVX-512 register of floats

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


// One task's share of the work: query heads [group] of one KV head over context tokens
// [t0, t1). Leaves the scores' maximum, the sum of exp(score - maximum) and the V rows
// weighted by exp(score - maximum), unnormalized, so chunks of one context can be combined.
struct Partial {
  float* max;  // [group]
  float* sum;  // [group]
  float* acc;  // [group, dim]
};

// Context tokens t0, t0 + 1, ... of one KV head through the block table: next() is the row of
// the current token, then steps on (a division per token, t / block_size, cost more than the
// dot products it addresses).
template <typename scalar_t>
struct TokenRows {
  const scalar_t* data;
  const int64_t* table;
  int64_t block_size, block_stride, token_stride, head_offset;
  int64_t block, offset;

  TokenRows(const scalar_t* data, const int64_t* table, int64_t t0, int64_t block_size,
            int64_t block_stride, int64_t token_stride, int64_t head_offset)
      : data(data), table(table), block_size(block_size), block_stride(block_stride),
        token_stride(token_stride), head_offset(head_offset), block(t0 / block_size),
        offset(t0 % block_size) {}

  const scalar_t* next() {
    const scalar_t* row = data + table[block] * block_stride + offset * token_stride + head_offset;
    if (++offset == block_size) {
      offset = 0;
      ++block;
    }
    return row;
  }
};

// Scores [group, len] -> exp(score - the row's maximum), in place; each row's maximum and sum
// into part.
inline void exp_scores(float* scores, int64_t group, int64_t len, Partial part) {
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * len;
    float lane_max[kLanes];
    std::fill(lane_max, lane_max + kLanes, s[0]);
    int64_t i = 0;
    for (; i + kLanes <= len; i += kLanes)
      for (int j = 0; j < kLanes; ++j) lane_max[j] = std::max(lane_max[j], s[i + j]);
    float max = s[0];
    for (int j = 0; j < kLanes; ++j) max = std::max(max, lane_max[j]);
    for (; i < len; ++i) max = std::max(max, s[i]);
    // Two loops: with the running sum in it, the exp loop stays scalar (a float sum may not be
    // reordered); alone it vectorizes, and the sum runs in kLanes partial sums.
    for (int64_t t = 0; t < len; ++t) s[t] = exp_nonpositive(s[t] - max);
    float lanes[kLanes] = {0.0f};
    int64_t t = 0;
    for (; t + kLanes <= len; t += kLanes)
      for (int j = 0; j < kLanes; ++j) lanes[j] += s[t + j];
    float sum = 0.0f;
    for (int j = 0; j < kLanes; ++j) sum += lanes[j];
    for (; t < len; ++t) sum += s[t];
    part.max[g] = max;
    part.sum[g] = sum;
  }
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

// Context tokens per chunk at least: below this a chunk's fixed costs outweigh the balance.
constexpr int64_t kMinChunkTokens = 64;

template <typename scalar_t>
void decode_kernel(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                   int64_t window, at::Tensor& out) {
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t table_width = block_tables.size(1);
  const scalar_t* q_data = query.data_ptr<scalar_t>();
  const scalar_t* k_data = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_data = v_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* out_data = out.data_ptr<scalar_t>();
  const int64_t q_stride_b = query.stride(0), q_stride_h = query.stride(1);
  const int64_t token_stride = kv_heads * dim;  // within a block
  const int64_t block_stride = block_size * token_stride;

  // Tasks are (sequence, KV head, chunk of the context): a KV head's query heads share every
  // K/V row read. With fewer (sequence, KV head) pairs than two per thread (batch 1: three
  // pairs on SmolLM2, so one thread did two and the other one), each context is cut into
  // chunks, attended apart and combined after, as flash-decoding does.
  const int64_t pairs = batch * kv_heads;
  // The first context token each sequence reads: past the window, the ones before it weigh 0.
  auto first_token = [&](int64_t b) { return window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0; };
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) longest = std::max(longest, lens[b] - first_token(b));
  const int64_t threads = at::get_num_threads();
  int64_t chunks = 1;
  if (pairs < 2 * threads)  // every pair in as many chunks as two per thread: an even split
    chunks = std::max<int64_t>(1, std::min(2 * threads, longest / kMinChunkTokens));
  std::vector<float> max_buf(pairs * chunks * group), sum_buf(pairs * chunks * group),
      acc_buf(pairs * chunks * group * dim);

  at::parallel_for(0, pairs * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * dim), row(dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t pair = task / chunks, chunk = task % chunks;
      const int64_t b = pair / kv_heads, kvh = pair % kv_heads;
      const int64_t first = first_token(b), span = lens[b] - first;
      const int64_t t0 = first + span * chunk / chunks, t1 = first + span * (chunk + 1) / chunks;
      Partial part{max_buf.data() + task * group, sum_buf.data() + task * group,
                   acc_buf.data() + task * group * dim};
      if (t1 == t0) {  // an empty chunk of a short context: adds nothing
        std::fill(part.max, part.max + group, -std::numeric_limits<float>::infinity());
        std::fill(part.sum, part.sum + group, 0.0f);
        std::fill(part.acc, part.acc + group * dim, 0.0f);
        continue;
      }
      scores.resize(group * (t1 - t0));
      for (int64_t g = 0; g < group; ++g) {
        to_float(q_data + b * q_stride_b + (kvh * group + g) * q_stride_h, q.data() + g * dim, dim);
        for (int64_t d = 0; d < dim; ++d) q[g * dim + d] *= static_cast<float>(scale);
      }
      const int64_t* table = tables + b * table_width;
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
        continue;
      }
#endif
      decode_task_generic<scalar_t>(q.data(), k_data, v_data, table, t0, t1, group, dim, block_size,
                                    block_stride, token_stride, offset, scores.data(), row.data(), part);
    }
  });

  // Combine each query head's chunks: rescale each to the largest maximum, then normalize.
  at::parallel_for(0, pairs, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(chunks);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / kv_heads, kvh = pair % kv_heads;
      for (int64_t g = 0; g < group; ++g) {
        float max = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < chunks; ++c) max = std::max(max, max_buf[(pair * chunks + c) * group + g]);
        float sum = 0.0f;
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t i = (pair * chunks + c) * group + g;
          weights[c] = sum_buf[i] == 0.0f ? 0.0f : std::exp(max_buf[i] - max);
          sum += weights[c] * sum_buf[i];
        }
        const float inv = 1.0f / sum;
        scalar_t* o = out_data + (b * heads + kvh * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) {
          float value = 0.0f;
          for (int64_t c = 0; c < chunks; ++c)
            value += weights[c] * acc_buf[((pair * chunks + c) * group + g) * dim + d];
          o[d] = static_cast<scalar_t>(value * inv);
        }
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "query [B, heads, D] and caches [blocks, block_size, kv_heads, D] expected");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(query.stride(2) == 1, "query rows must be contiguous");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(query.size(2) == k_cache.size(3) && query.size(1) % k_cache.size(2) == 0,
              "head_dim mismatch or query heads not a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int64");
  TORCH_CHECK(seq_lens.size(0) == query.size(0) && block_tables.size(0) == query.size(0),
              "one block table and one length per query");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no sliding window)");
  at::Tensor tables = block_tables.contiguous();
  at::Tensor lens = seq_lens.contiguous();
  // A loop, not lens.min()/max(): two reductions cost more than the kernel on a short batch.
  const int64_t* len_data = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < lens.numel(); ++b) {
    TORCH_CHECK(len_data[b] >= 1, "every sequence needs a token");
    TORCH_CHECK(len_data[b] <= tables.size(1) * k_cache.size(1), "a sequence is longer than its block table");
  }
  at::Tensor out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "float64 is not supported");
    } else {
      decode_kernel<scalar_t>(query, k_cache, v_cache, tables, lens, scale, window, out);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(splitserve_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
