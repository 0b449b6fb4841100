// Causal prefill attention on CPU in bfloat16, flash style: scores in float32, an online
// softmax over chunks of 64 keys, every product an AVX-512 BF16 dot product (vdpbf16ps).
// Reference and oracle: kernels/attention.py prefill_attention (torch SDPA).
//
// query [q_len, heads, D]; key/value [ctx, kv_heads, D] (ctx >= q_len; query i sits at
// position ctx - q_len + i and sees keys up to it) -> [q_len, heads, D]. D a multiple of 16.
// window > 0 (a sliding-window layer): query i sees only the `window` keys up to its own; key
// chunks wholly before a tile's window are skipped.
// prefill_attention_into does the same for several fresh prompts of one step in one call (each
// causal over its own rows of a packed [tokens, heads, D]), their tiles over the threads at once.
// Query head h reads KV head h / (heads / kv_heads), as transformers' repeat_kv does.
//
// Why not torch's own: its CPU flash kernel runs at about 40-75 GFLOP/s here on SmolLM2's
// shapes (head_dim 64, 3 query heads per KV head), a tenth of what the same core's bf16
// matrix products reach, and attention was over half of a 2048-token prefill.
//
// Layout: K and V are packed once per call so that one 512-bit load feeds 16 lanes of
// vdpbf16ps with the pairs it multiplies. K as [kv_head][16 keys][D/2 pairs][16][2]: a query's
// (d, d+1) pair, broadcast, times 16 keys' pairs gives 16 scores' partial sums at once.
// V as [kv_head][key pair][D/16][16 dims][2 keys]: a row's (p_k, p_k+1) probabilities,
// broadcast, times 16 dims of two keys accumulate 16 output dims at once.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <immintrin.h>

#include "elementwise_avx512.h"
#include "kv_pack_avx512.h"
#include "prefill_attention_amx.h"
#include "vector_math.h"

namespace {

namespace kv_pack = splitserve_cpu::kv_pack;
using splitserve_cpu::exp_nonpositive;

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

constexpr int kLanes = 16;   // floats in one register; keys per packed K vector
constexpr int kChunk = 64;   // keys per online-softmax step: 4 packed K vectors
constexpr int kVecs = kChunk / kLanes;
constexpr int kRows = 4;     // query rows (one query head at one position each) per tile
constexpr int kMaxDim = 256;
constexpr int kOutVecs = 4;  // output vectors of 16 dims per P V pass

struct Problem {
  const uint16_t* q;   // [q_len, heads, D]
  uint16_t* out;       // [q_len, heads, D]
  const c10::BFloat16* k;  // [ctx, kv_heads, D]: the keys, as given
  const c10::BFloat16* v;  // [ctx, kv_heads, D]: the values, as given
  const uint16_t* kp;  // packed K
  const uint16_t* vp;  // packed V
  int64_t q_len, ctx, heads, kv_heads, group, dim;
  int64_t padded;      // ctx rounded up to kChunk: packed keys per KV head
  float scale;
  int64_t window;      // 0: full causal attention
};

// Task `task` of packing (KV head h, 16 keys) of p's keys and values into kp and vp.
// K: pair p of the 16 keys is one 16-lane gather of 32-bit pairs (key j's pair p to lane j);
// V: each key pair's 16 dims at a time, the two keys' values interleaved by one permute. Keys
// past ctx pack as zeros. (Element by element, packing a cached context of 1,300 tokens took
// about as long as attending 44 new queries over it.)
BF16_TARGET void pack_block(const Problem& p, uint16_t* kp, uint16_t* vp, int64_t task) {
  const int64_t D = p.dim, pairs = D / 2, kv = p.kv_heads;
  const int64_t h = task / (p.padded / kLanes), block = task % (p.padded / kLanes);
  const int64_t first = block * kLanes, present = std::clamp<int64_t>(p.ctx - first, 0, kLanes);
  const __mmask16 keys = static_cast<__mmask16>((1u << present) - 1u);
  uint16_t* kdst = kp + (h * (p.padded / kLanes) + block) * pairs * 2 * kLanes;
  const auto* krow = reinterpret_cast<const int32_t*>(p.k + (std::min(first, p.ctx - 1) * kv + h) * D);
  for (int64_t dp = 0; dp < pairs; ++dp) {  // one key to the next: kv * D / 2 pairs
    _mm512_storeu_si512(kdst + dp * 2 * kLanes,
                        kv_pack::gather_pairs(krow, static_cast<int32_t>(kv * D / 2), keys, dp));
  }
  // The same 16 keys are 8 key pairs of packed V: lane 2i takes key 0's dim i, 2i + 1 key 1's.
  const auto* v = reinterpret_cast<const uint16_t*>(p.v);
  for (int64_t t0 = first; t0 < first + kLanes; t0 += 2) {
    kv_pack::interleave_pair(t0 < p.ctx ? v + (t0 * kv + h) * D : nullptr,
                             t0 + 1 < p.ctx ? v + ((t0 + 1) * kv + h) * D : nullptr,
                             vp + (h * (p.padded / 2) + t0 / 2) * D * 2, D);
  }
}

// Packing tasks of a problem: one per KV head and 16 keys.
int64_t pack_tasks(const Problem& p) { return p.kv_heads * (p.padded / kLanes); }

// acc_out[m][dv.., dv + NV vectors) = acc_out * rescale[m] + the chunk's probabilities of row m
// times V. Key pair outer, output vector inner: kRows x NV independent accumulators (16 for
// NV = 4) keep both FMA pipes busy, where one accumulator per row chained every dot product
// on the one before it (a third of the pipes' rate, measured: bench/prefill.py's attention
// layer 1.3x faster at 2,048 tokens); one broadcast of a row's probability pair feeds NV.
template <int NV>
BF16_TARGET inline void accumulate_pv(const uint16_t* vc, int64_t dvecs, int64_t dv,
                                      const int32_t (*probs)[kChunk / 2], const float* rescale,
                                      float (*acc_out)[kMaxDim]) {
  __m512 o[kRows][NV];
  for (int m = 0; m < kRows; ++m) {
    const __m512 r = _mm512_set1_ps(rescale[m]);
    for (int j = 0; j < NV; ++j)
      o[m][j] = _mm512_mul_ps(_mm512_load_ps(acc_out[m] + (dv + j) * kLanes), r);
  }
  for (int64_t kk = 0; kk < kChunk / 2; ++kk) {
    __m512bh vv[NV];
    for (int j = 0; j < NV; ++j)
      vv[j] = (__m512bh)_mm512_loadu_si512(vc + (kk * dvecs + dv + j) * 2 * kLanes);
    for (int m = 0; m < kRows; ++m) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(probs[m][kk]);
      for (int j = 0; j < NV; ++j) o[m][j] = _mm512_dpbf16_ps(o[m][j], pb, vv[j]);
    }
  }
  for (int m = 0; m < kRows; ++m)
    for (int j = 0; j < NV; ++j) _mm512_store_ps(acc_out[m] + (dv + j) * kLanes, o[m][j]);
}

// Rows [row0, row0 + rows) of KV head h: row r is position r / group, query head
// h * group + r % group. Rows are in position order, so the last one sees the most keys.
BF16_TARGET void attend_tile(const Problem& p, int64_t h, int64_t row0, int64_t rows) {
  const int64_t D = p.dim, pairs = D / 2, dvecs = D / kLanes, offset = p.ctx - p.q_len;
  const uint16_t* qrow[kRows];
  uint16_t* orow[kRows];
  int64_t pos[kRows], lo[kRows];  // row m sees keys [lo[m], pos[m]]
  for (int m = 0; m < kRows; ++m) {
    const int64_t r = row0 + std::min<int64_t>(m, rows - 1);  // a short tile repeats its last row
    const int64_t i = r / p.group, head = h * p.group + r % p.group;
    qrow[m] = p.q + (i * p.heads + head) * D;
    orow[m] = p.out + (i * p.heads + head) * D;
    pos[m] = offset + i;
    lo[m] = p.window > 0 ? std::max<int64_t>(0, pos[m] + 1 - p.window) : 0;
  }
  const int64_t limit = pos[kRows - 1] + 1;
  alignas(64) float acc_out[kRows][kMaxDim] = {};
  alignas(64) int32_t probs[kRows][kChunk / 2];
  float run_max[kRows], run_sum[kRows] = {}, rescale[kRows];
  std::fill(run_max, run_max + kRows, -std::numeric_limits<float>::infinity());
  const uint16_t* kbase = p.kp + h * (p.padded / kLanes) * pairs * 2 * kLanes;
  const uint16_t* vbase = p.vp + h * (p.padded / 2) * dvecs * 2 * kLanes;

  for (int64_t c0 = lo[0] / kChunk * kChunk; c0 < limit; c0 += kChunk) {
    __m512 s[kRows][kVecs];
    for (int m = 0; m < kRows; ++m)
      for (int v = 0; v < kVecs; ++v) s[m][v] = _mm512_setzero_ps();
    const uint16_t* kc = kbase + (c0 / kLanes) * pairs * 2 * kLanes;
    for (int64_t dp = 0; dp < pairs; ++dp) {
      __m512bh kv[kVecs];
      for (int v = 0; v < kVecs; ++v)
        kv[v] = (__m512bh)_mm512_loadu_si512(kc + (v * pairs + dp) * 2 * kLanes);
      for (int m = 0; m < kRows; ++m) {
        int32_t qq;
        std::memcpy(&qq, qrow[m] + 2 * dp, sizeof(qq));
        const __m512bh qb = (__m512bh)_mm512_set1_epi32(qq);
        for (int v = 0; v < kVecs; ++v) s[m][v] = _mm512_dpbf16_ps(s[m][v], qb, kv[v]);
      }
    }
    // Online softmax: keys past a row's position (and the padding past ctx), and those before
    // its window, weigh nothing.
    const __m512 scale = _mm512_set1_ps(p.scale);
    for (int m = 0; m < kRows; ++m) {
      const int64_t seen = std::clamp<int64_t>(pos[m] + 1 - c0, 0, kChunk);
      const int64_t before = std::clamp<int64_t>(lo[m] - c0, 0, kChunk);
      if (seen <= before) {
        rescale[m] = 1.0f;
        std::memset(probs[m], 0, sizeof(probs[m]));
        continue;
      }
      __mmask16 keep[kVecs];
      __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int v = 0; v < kVecs; ++v) {
        const int64_t n = std::clamp<int64_t>(seen - v * kLanes, 0, kLanes);
        const int64_t skip = std::clamp<int64_t>(before - v * kLanes, 0, kLanes);
        keep[v] = static_cast<__mmask16>(((1u << n) - 1u) & ~((1u << skip) - 1u));
        s[m][v] = _mm512_mul_ps(s[m][v], scale);
        vmax = _mm512_mask_max_ps(vmax, keep[v], vmax, s[m][v]);
      }
      const float new_max = std::max(run_max[m], _mm512_reduce_max_ps(vmax));
      rescale[m] = run_max[m] == -std::numeric_limits<float>::infinity()
                       ? 0.0f : exp_nonpositive(run_max[m] - new_max);
      const __m512 shift = _mm512_set1_ps(new_max);
      __m512 sum = _mm512_setzero_ps();
      for (int v = 0; v < kVecs; ++v) {
        const __m512 e = _mm512_maskz_mov_ps(keep[v], splitserve_cpu::avx512::exp_nonpositive(_mm512_sub_ps(s[m][v], shift)));
        sum = _mm512_add_ps(sum, e);
        // 16 keys' probabilities as bf16, in key order: 8 (key 2k, key 2k + 1) pairs.
        _mm256_store_si256(reinterpret_cast<__m256i*>(probs[m] + v * kLanes / 2),
                           (__m256i)_mm512_cvtneps_pbh(e));
      }
      run_sum[m] = run_sum[m] * rescale[m] + _mm512_reduce_add_ps(sum);
      run_max[m] = new_max;
    }

    // acc_out = acc_out * rescale + P V over the chunk's keys, up to 4 output vectors at once.
    const uint16_t* vc = vbase + (c0 / 2) * dvecs * 2 * kLanes;
    for (int64_t dv = 0; dv < dvecs; dv += kOutVecs) {
      switch (std::min<int64_t>(kOutVecs, dvecs - dv)) {
        case 4: accumulate_pv<4>(vc, dvecs, dv, probs, rescale, acc_out); break;
        case 3: accumulate_pv<3>(vc, dvecs, dv, probs, rescale, acc_out); break;
        case 2: accumulate_pv<2>(vc, dvecs, dv, probs, rescale, acc_out); break;
        default: accumulate_pv<1>(vc, dvecs, dv, probs, rescale, acc_out); break;
      }
    }
  }

  for (int m = 0; m < rows; ++m) {
    const __m512 inv = _mm512_set1_ps(1.0f / run_sum[m]);
    for (int64_t dv = 0; dv < dvecs; ++dv) {
      const __m512 o = _mm512_mul_ps(_mm512_load_ps(acc_out[m] + dv * kLanes), inv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow[m] + dv * kLanes),
                          (__m256i)_mm512_cvtneps_pbh(o));
    }
  }
}

void check_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  int64_t window) {
  TORCH_CHECK(splitserve_cpu::has_avx512_bf16(), "prefill_attention needs a CPU with AVX-512 BF16");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3,
              "query [q_len, heads, D], key and value [ctx, kv_heads, D]");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
              value.scalar_type() == at::kBFloat16, "prefill_attention is bfloat16 only");
  TORCH_CHECK(key.sizes() == value.sizes(), "key and value must have one shape");
  const int64_t heads = query.size(1), dim = query.size(2), kv_heads = key.size(1);
  TORCH_CHECK(key.size(2) == dim && dim % kLanes == 0 && dim <= kMaxDim,
              "head_dim must match and be a multiple of 16, at most 256");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no sliding window)");
}

// One sequence's problem: q_len query rows of q (and out) from q_row on, ctx key and value
// rows of k and v (contiguous) from k_row on; kp, vp unset.
Problem problem(const at::Tensor& q, const at::Tensor& out, int64_t q_row, int64_t q_len,
                const at::Tensor& k, const at::Tensor& v, int64_t k_row, int64_t ctx, double scale,
                int64_t window) {
  const int64_t heads = q.size(1), dim = q.size(2), kv_heads = k.size(1);
  const int64_t row = q_row * heads * dim, key = k_row * kv_heads * dim;
  return Problem{reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>()) + row,
                 reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()) + row,
                 k.data_ptr<c10::BFloat16>() + key, v.data_ptr<c10::BFloat16>() + key, nullptr, nullptr,
                 q_len, ctx, heads, kv_heads, heads / kv_heads, dim,
                 (ctx + kChunk - 1) / kChunk * kChunk, static_cast<float>(scale), window};
}

// Query tiles of a problem: kRows rows (a position's query heads of one KV head) each.
int64_t tiles_per_head(const Problem& p) { return (p.q_len * p.group + kRows - 1) / kRows; }

// Every tile of `problems` over the threads: packs their K and V, then attends. Tiles in zigzag order (first, last, second, second to
// last, ...), so the contiguous ranges parallel_for hands each thread mix short causal rows
// with long ones, and one sequence's tiles with another's.
void attend_all(std::vector<Problem>& problems) {
  const int64_t n = static_cast<int64_t>(problems.size());
  const int64_t kv = problems[0].kv_heads, dim = problems[0].dim;
  std::vector<int64_t> packed_at(n + 1, 0), tasks_at(n + 1, 0), tiles_at(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    packed_at[i + 1] = packed_at[i] + kv * problems[i].padded * dim;
    tasks_at[i + 1] = tasks_at[i] + pack_tasks(problems[i]);
    tiles_at[i + 1] = tiles_at[i] + kv * tiles_per_head(problems[i]);
  }
  std::vector<uint16_t> kp(packed_at[n]), vp(packed_at[n]);
  for (int64_t i = 0; i < n; ++i) {
    problems[i].kp = kp.data() + packed_at[i];
    problems[i].vp = vp.data() + packed_at[i];
  }
  // The problem holding global index u of a prefix-count array.
  auto owner = [n](const std::vector<int64_t>& at, int64_t u) {
    return static_cast<int64_t>(std::upper_bound(at.begin(), at.begin() + n + 1, u) - at.begin()) - 1;
  };
  at::parallel_for(0, tasks_at[n], 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t i = owner(tasks_at, u);
      pack_block(problems[i], kp.data() + packed_at[i], vp.data() + packed_at[i], u - tasks_at[i]);
    }
  });
  const int64_t tiles = tiles_at[n];
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t t = u % 2 == 0 ? u / 2 : tiles - 1 - u / 2;
      const int64_t i = owner(tiles_at, t), local = t - tiles_at[i];
      const Problem& p = problems[i];
      const int64_t per_head = tiles_per_head(p);
      const int64_t h = local / per_head, row0 = (local % per_head) * kRows;
      attend_tile(p, h, row0, std::min<int64_t>(kRows, p.q_len * p.group - row0));
    }
  });
}

// t itself where each row's D values are contiguous (the AMX path reads rows at any row and
// head strides), else a contiguous copy.
at::Tensor with_contiguous_rows(const at::Tensor& t) { return t.stride(2) == 1 ? t : t.contiguous(); }

at::Tensor prefill_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             double scale, int64_t window, bool amx) {
  check_inputs(query, key, value, window);
  const int64_t q_len = query.size(0), ctx = key.size(0);
  TORCH_CHECK(q_len >= 1 && ctx >= q_len, "need 1 <= q_len <= ctx");
  if (amx && splitserve_cpu::has_amx_bf16()) {
    return splitserve_cpu::prefill_attention_amx(with_contiguous_rows(query), with_contiguous_rows(key),
                                                 with_contiguous_rows(value), scale, window);
  }
  const at::Tensor q = query.contiguous(), k = key.contiguous(), v = value.contiguous();
  at::Tensor out = at::empty_like(q);
  std::vector<Problem> problems{problem(q, out, 0, q_len, k, v, 0, ctx, scale, window)};
  attend_all(problems);
  return out;
}

// Several fresh prompts of one step in one call: sequence i is rows [start, start + length) of
// query, key and value (seqs [n, 2] int64: start, length), causal attention over its own rows
// only, written to the same rows of out [tokens, heads, D]. Other rows of out are left as they
// are (a mixed step's decode rows go there). One call per layer instead of one per prompt: a
// 128-token prompt's attention is ~30 us of work, and each call's fork and join of the threads
// and its packing cost about as much again.
void prefill_attention_into(at::Tensor& out, const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& value, const at::Tensor& seqs, double scale,
                            int64_t window, bool amx) {
  check_inputs(query, key, value, window);
  const int64_t tokens = query.size(0);
  TORCH_CHECK(key.size(0) == tokens, "key and value must have one row per query row");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == at::kBFloat16 && out.is_contiguous(),
              "out must be contiguous bfloat16 of query's shape");
  TORCH_CHECK(seqs.dim() == 2 && seqs.size(1) == 2 && seqs.scalar_type() == at::kLong,
              "seqs must be int64 [sequences, 2] (start, length)");
  const at::Tensor spans = seqs.contiguous();
  const int64_t* s = spans.data_ptr<int64_t>();
  const int64_t n = spans.size(0);
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(s[2 * i] >= 0 && s[2 * i + 1] >= 1 && s[2 * i] + s[2 * i + 1] <= tokens,
                "sequence ", i, " (start ", s[2 * i], ", length ", s[2 * i + 1], ") is not within the ",
                tokens, " rows");
  if (n == 0) return;
  if (amx && splitserve_cpu::has_amx_bf16()) {
    splitserve_cpu::prefill_attention_amx_into(out, with_contiguous_rows(query), with_contiguous_rows(key),
                                               with_contiguous_rows(value), s, n, scale, window);
    return;
  }
  const at::Tensor q = query.contiguous(), k = key.contiguous(), v = value.contiguous();
  std::vector<Problem> problems;
  for (int64_t i = 0; i < n; ++i)
    problems.push_back(problem(q, out, s[2 * i], s[2 * i + 1], k, v, s[2 * i], s[2 * i + 1], scale, window));
  attend_all(problems);
}

// Prompts after a cached prefix, all of a step's in one call per layer, reading K/V from the
// paged cache (AMX only; see prefill_attention_amx_paged). seqs: int64 [n, 4] (query start,
// query length, context length, row of block_tables).
void prefill_attention_paged(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& seqs,
                             const at::Tensor& block_tables, double scale) {
  TORCH_CHECK(splitserve_cpu::has_amx_bf16(), "prefill_attention_paged needs AMX");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              "caches must be contiguous bfloat16 [blocks, block_size, kv_heads, D] of one shape");
  check_inputs(query, k_cache[0], v_cache[0], 0);
  TORCH_CHECK(query.stride(2) == 1, "each query row's D values must be contiguous");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == at::kBFloat16 && out.is_contiguous(),
              "out must be contiguous bfloat16 of query's shape");
  const int64_t blocks = k_cache.size(0), bs = k_cache.size(1), tokens = query.size(0);
  TORCH_CHECK(bs % kLanes == 0, "the block size must be a multiple of 16");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong && block_tables.stride(1) == 1,
              "block_tables must be int64 [rows, blocks] with contiguous rows");
  TORCH_CHECK(seqs.dim() == 2 && seqs.size(1) == 4 && seqs.scalar_type() == at::kLong && seqs.is_contiguous(),
              "seqs must be contiguous int64 [sequences, 4] (start, query length, context length, table row)");
  const int64_t* s = seqs.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < seqs.size(0); ++i) {
    const int64_t start = s[4 * i], q_len = s[4 * i + 1], ctx = s[4 * i + 2], row = s[4 * i + 3];
    TORCH_CHECK(start >= 0 && q_len >= 1 && start + q_len <= tokens && ctx >= q_len,
                "sequence ", i, " (start ", start, ", length ", q_len, ", context ", ctx,
                ") is not within the ", tokens, " rows");
    TORCH_CHECK(row >= 0 && row < block_tables.size(0) && (ctx + bs - 1) / bs <= block_tables.size(1),
                "sequence ", i, ": its block table row ", row, " is missing or too short");
    for (int64_t b = 0; b * bs < ctx; ++b) {
      const int64_t id = tables[row * block_tables.stride(0) + b];
      TORCH_CHECK(id >= 0 && id < blocks, "sequence ", i, ": block ", id, " is outside the cache");
    }
  }
  if (seqs.size(0) > 0)
    splitserve_cpu::prefill_attention_amx_paged(out, query, k_cache, v_cache, seqs, block_tables, scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def("prefill_attention(Tensor query, Tensor key, Tensor value, float scale, int window=0, "
        "bool amx=True) -> Tensor");
  m.def("prefill_attention_into(Tensor(a!) out, Tensor query, Tensor key, Tensor value, "
        "Tensor seqs, float scale, int window=0, bool amx=True) -> ()");
  m.def("prefill_attention_paged(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
        "Tensor seqs, Tensor block_tables, float scale) -> ()");
  m.def("has_amx_bf16() -> bool", &splitserve_cpu::has_amx_bf16);
}

TORCH_LIBRARY_IMPL(splitserve_cpu, CPU, m) {
  m.impl("prefill_attention", &prefill_attention);
  m.impl("prefill_attention_into", &prefill_attention_into);
  m.impl("prefill_attention_paged", &prefill_attention_paged);
}
