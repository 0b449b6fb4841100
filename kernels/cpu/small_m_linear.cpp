// Linear layer for a few rows in bfloat16 (decode): y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
// Each weight row is streamed from memory once and used for all M rows while it sits in L1,
// so a step reads the weights once however many rows it has; float32 accumulation.
// Reference and oracle: kernels/linear.py small_m_linear_reference.
//
// x [M, K] bf16 with unit stride along K (any row stride); W [N, K] bf16 contiguous (nn.Linear
// layout); bias [N] bf16 or none -> [M, N] bf16, rounded once from float32 like torch's mm.
// The fast path uses AVX-512 BF16 dot products (vdpbf16ps), chosen at run time where the CPU
// has them; elsewhere a portable loop computes the same products in float32 (another order).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vector_math.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SPLITSERVE_X86_BF16 1
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#endif

namespace {

// Weight rows per tile: they share each load of x, and their dot products run as independent
// chains. Rows of x per pass over a tile: NR * MR accumulators stay within the 32 registers.
constexpr int kTileRows = 4;
constexpr int kMaxPassRows = 4;
// Rows of x for which a tile reads its weight rows one after another (see dot_tile).
constexpr int kMinRowByRowRows = 2;
constexpr int kMaxRowByRowRows = 4;
// Software prefetch distance in weight rows (two tiles): measured with bench/cpu_linear.py, 8
// and 32 rows both lift 2-4 rows of x from ~18-21 GB/s to ~25-28 GB/s; none is slower.
constexpr int kPrefetchRows = 8;

struct Problem {
  const uint16_t* x;  // bf16 bits
  int64_t x_stride;   // elements between rows of x
  const uint16_t* w;  // bf16 bits, [N, K] contiguous
  const uint16_t* bias;  // bf16 bits [N], or null
  uint16_t* y;        // bf16 bits, [M, N] contiguous
  int64_t M, N, K;
};

inline float bf16_to_float(uint16_t bits) {
  uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &widened, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16(float f) { return c10::BFloat16(f).x; }  // round to nearest even

inline void store(const Problem& p, int64_t m, int64_t n, float sum) {
  if (p.bias != nullptr) sum += bf16_to_float(p.bias[n]);
  p.y[m * p.N + n] = float_to_bf16(sum);
}

// -- portable path ------------------------------------------------------------------------

constexpr int kLanes = 16;  // partial sums per dot product, so the compiler vectorizes it

void rows_portable(const Problem& p, int64_t n_begin, int64_t n_end) {
  float xf[kLanes];
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint16_t* w = p.w + n * p.K;
    for (int64_t m = 0; m < p.M; ++m) {
      const uint16_t* x = p.x + m * p.x_stride;
      float acc[kLanes] = {0.0f};
      int64_t k = 0;
      for (; k + kLanes <= p.K; k += kLanes) {
        for (int j = 0; j < kLanes; ++j) xf[j] = bf16_to_float(x[k + j]);
        for (int j = 0; j < kLanes; ++j) acc[j] += xf[j] * bf16_to_float(w[k + j]);
      }
      float sum = 0.0f;
      for (int j = 0; j < kLanes; ++j) sum += acc[j];
      for (; k < p.K; ++k) sum += bf16_to_float(x[k]) * bf16_to_float(w[k]);
      store(p, m, n, sum);
    }
  }
}

// -- AVX-512 BF16 path --------------------------------------------------------------------

#ifdef SPLITSERVE_X86_BF16

BF16_TARGET inline __m512bh load_bf16(const uint16_t* p) {
  return (__m512bh)_mm512_loadu_si512(p);
}

BF16_TARGET inline __m512bh load_bf16(const uint16_t* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// Sums of four accumulators, [sum(a), sum(b), sum(c), sum(d)]: one transposing tree instead
// of four separate horizontal reductions (which cost as much as the dot products at K = 576).
BF16_TARGET inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] and the same for c, d.
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // Per lane: [a, b, c, d] summed over the lane's four floats.
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// Four adjacent outputs of row m: bias added in float32, rounded to bf16 (nearest even) once.
BF16_TARGET inline void store4(const Problem& p, int64_t m, int64_t n, __m128 sums) {
  if (p.bias != nullptr) {
    const __m128i bits = _mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.bias + n)));
    sums = _mm_add_ps(sums, _mm_castsi128_ps(_mm_slli_epi32(bits, 16)));
  }
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p.y + m * p.N + n), (__m128i)_mm_cvtneps_pbh(sums));
}

// Adds the products of NR weight rows (from w) and MR rows of x (from x) into acc: 32
// values of K per step, each vdpbf16ps adding 16 float32 partial sums of pairs of products.
// Each output sums its products in order of k in one accumulator, in both loop orders below,
// so both give the same bits.
//
// kRowByRow: the weight rows one after another, so the tile's contiguous block is read in
// address order, each row's dot products one chain per row of x. Else the rows side by side, a
// step of each in turn: NR streams 2K bytes apart, but NR * MR independent chains. Measured
// against each other in one process on bench/cpu_linear.py's shapes (2 threads), in both of
// the states this machine's memory bandwidth switches between (~45-50 and ~60-90 GB/s at one
// row of x): row by row took 7-9% less time at 4 rows in the slower state (gate_up_proj
// 87.5 -> 79.5 us, lm_head 1281 -> 1187 us) and 0-8% less at 2-3 rows; 5-18% less at 2-4 rows
// in the faster one. At 1 row it was 3-20% faster in the faster state but up to 10% slower in
// the slower one (gate_up_proj 88 -> 97 us), so 1 row stays side by side; at 8 rows it was
// 15-27% slower (likely the dot product's latency: a weight row feeds MR chains, not NR * MR).
template <int NR, int MR, bool kRowByRow>
BF16_TARGET inline void dot_tile(const Problem& p, const uint16_t* w, const uint16_t* x,
                                 __m512 (&acc)[MR][NR]) {
  const int64_t k_steps = p.K & ~int64_t{31};  // K in whole steps of 32
  const __mmask32 tail_mask = static_cast<__mmask32>((uint64_t{1} << (p.K - k_steps)) - 1);
  // The rows kPrefetchRows ahead, a cache line per line read: the hardware prefetcher alone
  // leaves the loads waiting once a tile does more than one row of x's work. A prefetch past
  // the end of the weights is harmless: it never faults.
  const char* ahead = reinterpret_cast<const char*>(w + kPrefetchRows * p.K);
  if constexpr (kRowByRow) {
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) {
      const uint16_t* wr = w + r * p.K;
      const char* ahead_r = ahead + r * p.K * 2;
      int64_t k = 0;
      for (; k < k_steps; k += 32) {
        const __m512bh wv = load_bf16(wr + k);
        _mm_prefetch(ahead_r + k * 2, _MM_HINT_T0);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i)
          acc[i][r] = _mm512_dpbf16_ps(acc[i][r], load_bf16(x + i * p.x_stride + k), wv);
      }
      if (k < p.K) {  // masked loads read zeros past K, which add nothing
        const __m512bh wv = load_bf16(wr + k, tail_mask);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i)
          acc[i][r] = _mm512_dpbf16_ps(acc[i][r], load_bf16(x + i * p.x_stride + k, tail_mask), wv);
      }
    }
  } else {
    int64_t k = 0;
    for (; k < k_steps; k += 32) {
      __m512bh wv[NR];
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) wv[r] = load_bf16(w + r * p.K + k);
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) _mm_prefetch(ahead + (r * p.K + k) * 2, _MM_HINT_T0);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const __m512bh xv = load_bf16(x + i * p.x_stride + k);
#pragma GCC unroll 16
        for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv, wv[r]);
      }
    }
    if (k < p.K) {  // masked loads read zeros past K, which add nothing
      __m512bh wv[NR];
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) wv[r] = load_bf16(w + r * p.K + k, tail_mask);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const __m512bh xv = load_bf16(x + i * p.x_stride + k, tail_mask);
#pragma GCC unroll 16
        for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv, wv[r]);
      }
    }
  }
}

// NR weight rows (from `n`) times MR rows of x (from `m`). NR is 1 or a multiple of 4.
template <int NR, int MR, bool kRowByRow>
BF16_TARGET void tile_bf16(const Problem& p, int64_t m, int64_t n) {
  __m512 acc[MR][NR];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_setzero_ps();
  dot_tile<NR, MR, kRowByRow>(p, p.w + n * p.K, p.x + m * p.x_stride, acc);
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    if constexpr (NR == 1) {
      store(p, m + i, n, _mm512_reduce_add_ps(acc[i][0]));
    } else {
#pragma GCC unroll 16
      for (int r = 0; r < NR; r += 4)
        store4(p, m + i, n + r, reduce4(acc[i][r], acc[i][r + 1], acc[i][r + 2], acc[i][r + 3]));
    }
  }
}

// All rows of x times NR weight rows, in passes of at most kMaxPassRows rows of x. Four rows
// row by row go as a pass of 3 (reading the weights from memory) then a pass of 1 (from L1):
// 5-7% faster than one pass of 4 on qkv_proj, o_proj and gate_up_proj, lm_head within noise
// (faster state), 10-13% faster on all in the slower state.
template <int NR, bool kRowByRow>
BF16_TARGET void rows_of_x_bf16(const Problem& p, int64_t n) {
  if (kRowByRow && p.M == 4) {
    tile_bf16<NR, 3, kRowByRow>(p, 0, n);
    tile_bf16<NR, 1, kRowByRow>(p, 3, n);
    return;
  }
  int64_t m = 0;
  for (; m + kMaxPassRows <= p.M; m += kMaxPassRows) tile_bf16<NR, kMaxPassRows, kRowByRow>(p, m, n);
  switch (p.M - m) {
    case 3: tile_bf16<NR, 3, kRowByRow>(p, m, n); break;
    case 2: tile_bf16<NR, 2, kRowByRow>(p, m, n); break;
    case 1: tile_bf16<NR, 1, kRowByRow>(p, m, n); break;
    default: break;
  }
}

template <bool kRowByRow>
BF16_TARGET void rows_bf16(const Problem& p, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + kTileRows <= n_end; n += kTileRows) rows_of_x_bf16<kTileRows, kRowByRow>(p, n);
  for (; n < n_end; ++n) rows_of_x_bf16<1, kRowByRow>(p, n);
}

// Row by row from 2 to 4 rows of x, side by side otherwise (see dot_tile).
BF16_TARGET void rows_bf16(const Problem& p, int64_t n_begin, int64_t n_end) {
  if (p.M >= kMinRowByRowRows && p.M <= kMaxRowByRowRows) return rows_bf16<true>(p, n_begin, n_end);
  rows_bf16<false>(p, n_begin, n_end);
}

#endif

at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias, bool portable) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "x [M, K] and weight [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "x and weight must be bfloat16");
  TORCH_CHECK(x.size(1) == weight.size(1), "x has ", x.size(1), " features, weight ", weight.size(1));
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  const at::Tensor xr = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kBFloat16 && b.dim() == 1 && b.size(0) == N,
                "bias must be bfloat16 [N]");
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return b.defined() ? y.copy_(b.expand({M, N})) : y.zero_();
  const Problem p{
      reinterpret_cast<const uint16_t*>(xr.data_ptr<at::BFloat16>()), xr.stride(0),
      reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()),
      b.defined() ? reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>()) : nullptr,
      reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), M, N, K};
  const bool fast = !portable && splitserve_cpu::has_avx512_bf16();
  // Threads split N in whole tiles; a chunk under ~64 KB of weights is not worth a thread.
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (kTileRows * K * 2));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    const int64_t n_begin = begin * kTileRows, n_end = std::min(N, end * kTileRows);
#ifdef SPLITSERVE_X86_BF16
    if (fast) return rows_bf16(p, n_begin, n_end);
#endif
    rows_portable(p, n_begin, n_end);
  });
  return y;
}

bool cpu_has_avx512_bf16() { return splitserve_cpu::has_avx512_bf16(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def("small_m_linear(Tensor x, Tensor weight, Tensor? bias=None, bool portable=False) -> Tensor");
  m.def("cpu_has_avx512_bf16() -> bool", &cpu_has_avx512_bf16);
}

TORCH_LIBRARY_IMPL(splitserve_cpu, CPU, m) { m.impl("small_m_linear", &small_m_linear); }
