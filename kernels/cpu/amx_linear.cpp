// Linear layers on AMX tiles from weights packed once into the tiles' own layout (bfloat16,
// float32 accumulation, rounded once): y = x W^T (+ bias) for x [M, K], W [N, K].
// Reference and oracle: kernels/linear.py small_m_linear_reference (F.linear's arithmetic).
//
// Why not torch's oneDNN matmul on the same tiles: at decode's few rows a step streams every
// weight from memory once, and oneDNN's matmul, even from weights it packed beforehand, took
// 1.5-1.7x this loop's time for a SmolLM2 decoder layer's projections at 1-32 rows, 1.1-1.2x at
// 33-64 (`python bench/cpu_linear.py --rows 1,8,16,32,33,64 --layouts packed,amx
// --skip-engine`); at prefill's hundreds of rows the engine takes torch's F.linear instead
// (kernels/linear.py PACKED_MAX_ROWS).
//
// Layout (amx_pack_linear_weight): W^T in the VNNI order AMX multiplies (input features in
// pairs, a pair of one output column one 32-bit word), in blocks of 32 output columns:
// [cdiv(N, 32), K / 2, 32, 2], zero columns past N. One block's weights are one contiguous
// run, read front to back: a step of 32 input features is 2 KiB, two B tiles (16 columns each,
// rows 128 bytes apart).
//
// Up to 64 rows: our loop, up to 32 rows per pass over a block (configure: which tiles hold
// what), a second pass reading the block from L2. More rows: oneDNN's batch-reduce GEMM
// micro-kernel (torch's at::native::cpublas::brgemm) on the same layout, a block at a time:
// at 96 rows it took 0.89x our loop's time on SmolLM2's layers, the same at 128-384.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define SPLITSERVE_AMX_LINEAR 1
#endif

#include "amx_linear.h"
#include "prefill_attention_amx.h"

namespace {

constexpr int64_t kBlockCols = 32;  // output columns per block: two accumulator tiles of 16
constexpr int64_t kStep = 32;       // K per step: one A tile row holds 32 bfloat16
constexpr int64_t kStepElems = kStep * kBlockCols;  // a block's step: 16 pair rows x 32 columns x 2
constexpr int64_t kRowBytes = kBlockCols * 2 * 2;  // a pair row of a block: 32 columns x 2 bf16
constexpr int64_t kMaxRows = 32;    // rows per pass over a block: two row groups of 16
// Past this many rows oneDNN's micro-kernel takes over (see the top of this file), a block's
// rows in one call up to kGemmRows (the engine sends larger inputs to F.linear, kernels/linear.py):
// cut into 128-row calls, 192 rows took 12% longer.
constexpr int64_t kOwnMaxRows = 64;
constexpr int64_t kGemmRows = 384;
constexpr int64_t kPrefetchSteps = 4;  // steps of B prefetched ahead of the one multiplied

bool amx_usable() {
#ifdef SPLITSERVE_AMX_LINEAR
  // has_amx_bf16: the CPU's AMX BF16, which oneDNN's micro-kernel (more than kOwnMaxRows
  // rows) needs too. Linux hands a process the AMX tile state only when asked
  // (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); asking again is harmless, and oneDNN asks the same.
  static const bool usable = splitserve_cpu::has_amx_bf16() && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return usable;
#else
  return false;
#endif
}

#ifdef SPLITSERVE_AMX_LINEAR
#define SPLITSERVE_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The tiles for a pass of `rows` (1 to 32) rows. Tile state is per thread: every thread that
// runs passes configures its own, and releases it when done. Tiles 0-1 accumulate rows 0-15
// (columns 0-15, 16-31), 2-3 rows 16-31 (more than 16 rows only); 4-5 are the two row groups
// of x (A), 6-7 a step's two B tiles.
SPLITSERVE_AMX void configure(int64_t rows) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  const uint8_t top = static_cast<uint8_t>(std::min<int64_t>(rows, 16));
  config.rows[0] = config.rows[1] = config.rows[4] = top;
  config.rows[2] = config.rows[3] = config.rows[5] = rows > 16 ? static_cast<uint8_t>(rows - 16) : top;
  _tile_loadconfig(&config);
}

// The B tiles kPrefetchSteps steps ahead, into L1 (from memory on a block's first pass, from L2
// on the next).
inline void prefetch_step(const at::BFloat16* b) {
  const char* ahead = reinterpret_cast<const char*>(b + kPrefetchSteps * kStepElems);
  for (int line = 0; line < 32; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
}

// One block's 32 columns for up to 16 rows of x (row stride ldx), or with kTwoGroups 17 to 32
// rows (two row groups sharing each step's B tiles), summed over K in float32 into acc
// [rows, 32]. (Measured against it on SmolLM2's layers: alternating two sets of A and B tiles
// between steps, or two accumulator pairs, took as long or up to 5% longer.)
template <bool kTwoGroups>
SPLITSERVE_AMX void block_pass(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w,
                               int64_t steps, float* acc) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kTwoGroups) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t row_bytes = ldx * static_cast<int64_t>(sizeof(at::BFloat16));
  for (int64_t s = 0; s < steps; ++s) {
    const at::BFloat16* b = w + s * kStepElems;
    prefetch_step(b);
    _tile_loadd(4, x + s * kStep, row_bytes);
    _tile_loadd(6, b, kRowBytes);
    _tile_loadd(7, b + 32, kRowBytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kTwoGroups) {
      _tile_loadd(5, x + 16 * ldx + s * kStep, row_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc, kBlockCols * sizeof(float));
  _tile_stored(1, acc + 16, kBlockCols * sizeof(float));
  if constexpr (kTwoGroups) {
    _tile_stored(2, acc + 16 * kBlockCols, kBlockCols * sizeof(float));
    _tile_stored(3, acc + 16 * kBlockCols + 16, kBlockCols * sizeof(float));
  }
}

// acc [rows, 32] (+ bias[0:cols]) rounded to bfloat16 into out's first `cols` columns.
SPLITSERVE_AMX void store_block(const float* acc, int64_t rows, const at::BFloat16* bias,
                                int64_t cols, at::BFloat16* out, int64_t ldo) {
  const __mmask32 mask = cols >= 32 ? 0xFFFFFFFFu : ((1u << cols) - 1u);
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    alignas(64) float widened[32] = {};
    for (int64_t c = 0; c < cols; ++c) widened[c] = static_cast<float>(bias[c]);
    b0 = _mm512_load_ps(widened);
    b1 = _mm512_load_ps(widened + 16);
  }
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 lo = _mm512_add_ps(_mm512_loadu_ps(acc + m * kBlockCols), b0);
    const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(acc + m * kBlockCols + 16), b1);
    _mm512_mask_storeu_epi16(out + m * ldo, mask, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

struct Problem {
  const at::BFloat16* x;
  int64_t ldx;
  const at::BFloat16* w;  // packed
  const at::BFloat16* bias;  // [N] or null
  at::BFloat16* out;  // [M, N]
  int64_t rows, n, steps, chunks, chunk_rows;
};

// Tasks [begin, end): task t is block t / chunks over the rows of chunk t % chunks, so a
// thread's consecutive tasks share a block (its weights in L2 for the later chunks).
SPLITSERVE_AMX void run_tasks(const Problem& p, int64_t begin, int64_t end) {
  alignas(64) float acc[kMaxRows * kBlockCols];
  int64_t configured = -1;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t block = t / p.chunks, chunk = t % p.chunks;
    const int64_t r0 = chunk * p.chunk_rows, r1 = std::min(p.rows, r0 + p.chunk_rows);
    const int64_t col0 = block * kBlockCols, cols = std::min(kBlockCols, p.n - col0);
    const at::BFloat16* w = p.w + block * p.steps * kStepElems;
    for (int64_t m0 = r0; m0 < r1; m0 += kMaxRows) {
      const int64_t rows = std::min(kMaxRows, r1 - m0);
      if (rows != configured) {
        configure(rows);
        configured = rows;
      }
      if (rows > 16)
        block_pass<true>(p.x + m0 * p.ldx, p.ldx, w, p.steps, acc);
      else
        block_pass<false>(p.x + m0 * p.ldx, p.ldx, w, p.steps, acc);
      store_block(acc, rows, p.bias == nullptr ? nullptr : p.bias + col0, cols,
                  p.out + m0 * p.n + col0, p.n);
    }
  }
  if (configured >= 0) _tile_release();
}

// Tasks [begin, end) of more than kOwnMaxRows rows: task t is block t / chunks over rows
// [chunk * kGemmRows, + kGemmRows) of chunk t % chunks, by oneDNN's micro-kernel. It keeps
// its tile configuration per thread between calls; released at the end, the next call (ours
// or torch's) configures afresh.
void run_gemm_tasks(const Problem& p, int64_t begin, int64_t end) {
  std::vector<float> acc(kGemmRows * kBlockCols);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t block = t / p.chunks, r0 = t % p.chunks * kGemmRows;
    const int64_t rows = std::min(kGemmRows, p.rows - r0);
    const int64_t col0 = block * kBlockCols, cols = std::min(kBlockCols, p.n - col0);
    at::native::cpublas::brgemm(rows, kBlockCols, p.steps * kStep, p.ldx, kBlockCols, kBlockCols, false,
                                p.x + r0 * p.ldx, p.w + block * p.steps * kStepElems, acc.data());
    store_block(acc.data(), rows, p.bias == nullptr ? nullptr : p.bias + col0, cols,
                p.out + r0 * p.n + col0, p.n);
  }
  at::native::cpublas::brgemm_release();
}
#endif

void check_packed(const at::Tensor& packed, int64_t k, int64_t n) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == kBlockCols && packed.size(3) == 2,
              "packed must be a weight as amx_pack_linear_weight returned it");
  TORCH_CHECK(packed.size(1) * 2 == k, "x has ", k, " input features, the packed weight ",
              packed.size(1) * 2);
  TORCH_CHECK(n > 0 && (n + kBlockCols - 1) / kBlockCols == packed.size(0),
              "out_features ", n, " does not match the packed weight's ", packed.size(0), " blocks");
}

}  // namespace

namespace splitserve_cpu {

bool has_amx_linear() { return amx_usable(); }

// weight [N, K] bfloat16, K a multiple of 32 -> the tiles' layout (see the top of this file).
at::Tensor amx_pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "weight must be [N, K] bfloat16");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k > 0 && k % kStep == 0, "in_features (", k, ") must be a multiple of ", kStep);
  const at::Tensor w = weight.contiguous();
  const int64_t blocks = (n + kBlockCols - 1) / kBlockCols, pairs = k / 2;
  at::Tensor packed = at::zeros({blocks, pairs, kBlockCols, 2}, weight.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block)
      for (int64_t pair = 0; pair < pairs; ++pair)
        for (int64_t col = 0; col < kBlockCols; ++col) {
          const int64_t row = block * kBlockCols + col;  // W's row: an output column
          if (row >= n) break;
          uint16_t* d = dst + ((block * pairs + pair) * kBlockCols + col) * 2;
          d[0] = src[row * k + 2 * pair];
          d[1] = src[row * k + 2 * pair + 1];
        }
  });
  return packed;
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed,
                      const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(amx_usable(), "amx_linear needs a CPU with AMX BF16 (see has_amx_linear)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be [M, K] bfloat16");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t rows = xc.size(0), k = xc.size(1), n = out_features;
  check_packed(packed, k, n);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kBFloat16,
                "bias must be [N] bfloat16");
    b = bias->contiguous();
  }
  at::Tensor out = at::empty({rows, n}, xc.options());
  if (rows == 0) return out;
#ifdef SPLITSERVE_AMX_LINEAR
  const int64_t blocks = packed.size(0), steps = packed.size(1) / 16;
  const Problem base{xc.data_ptr<at::BFloat16>(), xc.stride(0), packed.data_ptr<at::BFloat16>(),
                     b.defined() ? b.data_ptr<at::BFloat16>() : nullptr, out.data_ptr<at::BFloat16>(),
                     rows, n, steps, 1, 0};
  if (rows > kOwnMaxRows) {
    Problem p = base;
    p.chunks = (rows + kGemmRows - 1) / kGemmRows;
    at::parallel_for(0, blocks * p.chunks, 1, [&](int64_t begin, int64_t end) { run_gemm_tasks(p, begin, end); });
    return out;
  }
  // Blocks are the tasks; where there are too few for the threads (a narrow layer, many rows),
  // the rows are cut in chunks of whole 32-row passes too.
  const int64_t threads = at::get_num_threads();
  const int64_t passes = (rows + kMaxRows - 1) / kMaxRows;
  const int64_t chunks = std::min(passes, std::max<int64_t>(1, (4 * threads + blocks - 1) / blocks));
  Problem p = base;
  p.chunk_rows = (passes + chunks - 1) / chunks * kMaxRows;
  p.chunks = (rows + p.chunk_rows - 1) / p.chunk_rows;
  at::parallel_for(0, blocks * p.chunks, 1, [&](int64_t begin, int64_t end) { run_tasks(p, begin, end); });
#endif
  return out;
}

}  // namespace splitserve_cpu

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def("has_amx_linear() -> bool", &splitserve_cpu::has_amx_linear);
  m.def("amx_pack_linear_weight(Tensor weight) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve_cpu, CPU, m) {
  m.impl("amx_pack_linear_weight", &splitserve_cpu::amx_pack_linear_weight);
  m.impl("amx_linear", &splitserve_cpu::amx_linear);
}
