// Causal prefill attention in bfloat16 on AMX tiles, flash style: each task takes 128 positions
// of one query head, walks its keys in blocks of up to 256, scores them with one batch-reduce
// GEMM (torch's at::native::cpublas::brgemm: oneDNN's micro-kernel, AMX where present), keeps
// an online softmax in float32 and adds the block's P V with a second GEMM. Called by
// prefill_attention (prefill_attention.cpp) where has_amx_bf16(); same contract and reference
// (kernels/attention.py prefill_attention).
//
// Why: on a host where AMX is fast and AVX-512 BF16 dot products are not, the vdpbf16ps kernel
// took 27 ms and torch's SDPA 11 ms for one layer of a 2,048-token prompt in 512-token chunks
// (SmolLM2's heads), while the GEMMs alone run at 1.5-2.7 TFLOP/s per core.
//
// Layout: the GEMMs read B in VNNI order (pairs along K interleaved), so K and V are packed
// once per call, per KV head: K^T as [D/2][padded keys][2] (a key's (d, d+1) pair is one
// 32-bit word: K^T is a transpose of 32-bit words), V as [padded keys/2][D][2] (two keys'
// rows interleaved). Keys past ctx are zeros, so masked probabilities (0) never meet NaN.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <vector>

#include <immintrin.h>

#include "kv_pack_avx512.h"
#include "prefill_attention_amx.h"
#include "vector_math.h"

namespace splitserve_cpu {
namespace {

namespace kv_pack = splitserve_cpu::kv_pack;

#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

constexpr int64_t kPositions = 128;  // query positions (of one head) per task
constexpr int64_t kKeys = 256;      // keys per online-softmax step
constexpr int64_t kAlign = 32;      // a task's first key block starts on a multiple of this
constexpr int kLanes = 16;

// Keys [key0, key0 + len) of a sequence's context, packed at slots [slot0, slot0 + len).
struct Run {
  int64_t slot0, key0, len;
};

struct Problem {
  const at::BFloat16* q;   // [q_len, heads, D], rows and heads at the strides below
  int64_t q_row, q_head;
  at::BFloat16* out;       // [q_len, heads, D]
  const at::BFloat16* kt;  // [kv_heads][D/2][padded][2]
  const at::BFloat16* vv;  // [kv_heads][padded/2][D][2]
  int64_t q_len, ctx, heads, group, dim, padded;  // padded: slots per KV head (>= ctx)
  float scale_log2;        // scale * log2(e): scores go straight to exp2
  int64_t window;
  // Where the context's keys are packed, in key order: runs[0, num_runs) (one run {0, 0, ctx}
  // when the keys are packed in order from slot 0).
  const Run* runs;
  int64_t num_runs;
};

// 2^x for x <= 0, 16 at a time: 2^n * 2^f, n = round(x), 2^f on [-1/2, 1/2] by a cubic fitted
// for relative error (below 7.5e-5, a fiftieth of the bf16 rounding the probabilities then
// get; the degree-4 Taylor polynomial before it had 5e-5 for one more FMA per 16 scores).
AMX_TARGET inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(0.055171613f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24261117f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69326103f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99992806f));
  return _mm512_scalef_ps(p, n);
}

// Lanes [begin, end) of a 16-lane vector, both relative to its first lane.
inline __mmask16 lanes(int64_t begin, int64_t end) {
  const int64_t hi = std::clamp<int64_t>(end, 0, kLanes), lo = std::clamp<int64_t>(begin, 0, kLanes);
  return static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

struct Scratch {
  std::vector<float> scores, acc;
  std::vector<at::BFloat16> probs, values;  // values: a key block's V gathered from several runs
  float max[kPositions], sum[kPositions];
  explicit Scratch(int64_t dim)
      : scores(kPositions * kKeys), acc(kPositions * dim), probs(kPositions * kKeys), values(kKeys * dim) {}
};

// Scores of block [n0, n0 + n) -> probabilities (bf16) and the running max and sum; rescales
// each row's accumulator by how much its max rose. Row m sits at position pos0 + m.
AMX_TARGET void softmax_block(const Problem& p, Scratch& s, int64_t rows, int64_t pos0, int64_t n0,
                              int64_t n, bool first) {
  const __m512 c = _mm512_set1_ps(p.scale_log2);
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t pos = pos0 + m;
    const int64_t lo = (p.window > 0 ? std::max<int64_t>(0, pos + 1 - p.window) : 0) - n0;
    const int64_t hi = std::min<int64_t>(pos + 1 - n0, n);  // visible: [lo, hi) of the block
    const float* row = s.scores.data() + m * kKeys;
    auto* prob = reinterpret_cast<uint16_t*>(s.probs.data() + m * kKeys);
    if (first) {
      s.max[m] = -std::numeric_limits<float>::infinity();
      s.sum[m] = 0.0f;
    }
    if (hi <= std::max<int64_t>(lo, 0)) {  // nothing visible here: weighs nothing
      std::memset(prob, 0, n * sizeof(uint16_t));
      continue;
    }
    // Whole vectors inside [lo, hi) need no mask; only the (at most two) at its ends do. The
    // vectors wholly outside it are zeros, not computed: on the diagonal block of a causal
    // task that is about half the block.
    auto keep = [lo, hi](int64_t j) -> __mmask16 {
      return j >= lo && j + kLanes <= hi ? static_cast<__mmask16>(0xFFFF) : lanes(lo - j, hi - j);
    };
    const int64_t begin = std::max<int64_t>(lo, 0) / kLanes * kLanes;
    const int64_t end = std::min<int64_t>(n, (hi + kLanes - 1) / kLanes * kLanes);
    std::memset(prob, 0, begin * sizeof(uint16_t));
    std::memset(prob + end, 0, (n - end) * sizeof(uint16_t));
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = begin; j < end; j += kLanes) {
      vmax = _mm512_mask_max_ps(vmax, keep(j), vmax, _mm512_loadu_ps(row + j));
    }
    // scale > 0, so the scaled scores' max is the max scaled.
    const float new_max = std::max(s.max[m], _mm512_reduce_max_ps(vmax) * p.scale_log2);
    const __m512 shift = _mm512_set1_ps(new_max);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = begin; j < end; j += kLanes) {
      const __m512 e = _mm512_maskz_mov_ps(
          keep(j), exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(row + j), c, shift)));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prob + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    if (!first && new_max > s.max[m]) {
      const float alpha = s.max[m] == -std::numeric_limits<float>::infinity()
                              ? 0.0f : exp2f(s.max[m] - new_max);
      s.sum[m] *= alpha;
      float* acc = s.acc.data() + m * p.dim;
      const __m512 a = _mm512_set1_ps(alpha);
      for (int64_t d = 0; d < p.dim; d += kLanes) _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), a));
    }
    s.sum[m] += _mm512_reduce_add_ps(sum);
    s.max[m] = new_max;
  }
}

// Positions [i0, i0 + rows) of query head `head`.
AMX_TARGET void attend_task(const Problem& p, Scratch& s, int64_t head, int64_t i0, int64_t rows) {
  namespace blas = at::native::cpublas;
  const int64_t D = p.dim, h = head / p.group, offset = p.ctx - p.q_len;
  const int64_t pos0 = offset + i0, last = pos0 + rows - 1;
  const int64_t lo = p.window > 0 ? std::max<int64_t>(0, pos0 + 1 - p.window) : 0;
  const at::BFloat16* q = p.q + i0 * p.q_row + head * p.q_head;
  const at::BFloat16* kt = p.kt + h * (D / 2) * p.padded * 2;
  const at::BFloat16* vv = p.vv + h * (p.padded / 2) * D * 2;
  bool first = true;
  int64_t r = 0;  // the run holding key n0
  for (int64_t n0 = lo / kAlign * kAlign; n0 <= last; n0 += kKeys) {
    // Up to the last row's position, rounded up to 16 keys: past the context the slots are
    // masked off (zeros, or keys of other blocks that no row here may see).
    const int64_t n = std::min<int64_t>(kKeys, (last + 1 - n0 + kLanes - 1) / kLanes * kLanes);
    while (p.runs[r].key0 + p.runs[r].len <= n0) ++r;
    const Run& run = p.runs[r];
    if (n0 + n <= run.key0 + run.len || r == p.num_runs - 1) {  // the keys' slots are in a row
      const int64_t slot = run.slot0 + n0 - run.key0;
      blas::brgemm(rows, n, D, p.q_row, p.padded, kKeys, false, q, kt + slot * 2, s.scores.data());
      softmax_block(p, s, rows, pos0, n0, n, first);
      blas::brgemm(rows, D, n, kKeys, D, D, !first, s.probs.data(), vv + slot * D, s.acc.data());
    } else {
      // Keys from several runs: each run's scores into its columns, its V into a row of the
      // block's copy, so the softmax and P V go as for keys in a row (the same arithmetic).
      for (int64_t k = r, a = n0; a < n0 + n; ++k) {
        const Run& piece = p.runs[k];
        const int64_t end = k == p.num_runs - 1 ? n0 + n : std::min(n0 + n, piece.key0 + piece.len);
        const int64_t slot = piece.slot0 + a - piece.key0;
        blas::brgemm(rows, end - a, D, p.q_row, p.padded, kKeys, false, q, kt + slot * 2,
                     s.scores.data() + (a - n0));
        std::memcpy(s.values.data() + (a - n0) * D, vv + slot * D, (end - a) * D * sizeof(at::BFloat16));
        a = end;
      }
      softmax_block(p, s, rows, pos0, n0, n, first);
      blas::brgemm(rows, D, n, kKeys, D, D, !first, s.probs.data(), s.values.data(), s.acc.data());
    }
    first = false;
  }
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 inv = _mm512_set1_ps(1.0f / s.sum[m]);
    const float* acc = s.acc.data() + m * D;
    at::BFloat16* o = p.out + ((i0 + m) * p.heads + head) * D;
    for (int64_t d = 0; d < D; d += kLanes) {  // rounded to nearest even, as at::BFloat16 does
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + d), inv)));
    }
  }
}

}  // namespace

bool has_amx_bf16() {
  static const bool has = has_avx512_bf16() && at::native::cpublas::could_pack(at::kBFloat16);
  return has;
}

namespace {

// One key of one KV head into slot `slot` of its K^T [D/2][padded] (32-bit pairs) and V
// [padded/2][D][2]; krow/vrow nullptr: zeros.
inline void pack_slot(const uint16_t* krow, const uint16_t* vrow, uint32_t* kdst, uint16_t* vdst,
                      int64_t slot, int64_t padded, int64_t D) {
  uint16_t* vpair = vdst + (slot / 2) * D * 2 + slot % 2;
  for (int64_t d2 = 0; d2 < D / 2; ++d2) {
    uint32_t word = 0;
    if (krow != nullptr) std::memcpy(&word, krow + 2 * d2, sizeof(word));
    kdst[d2 * padded + slot] = word;
  }
  for (int64_t d = 0; d < D; ++d) vpair[2 * d] = vrow != nullptr ? vrow[d] : 0;
}

// Problems' tasks (positions of a query head, kPositions at a time) over the threads, in zigzag
// order (first, last, second, second to last, ...): each thread's contiguous range mixes short
// causal rows with long ones, and one prompt's tasks with another's.
void attend_problems(const std::vector<Problem>& problems) {
  const int64_t n = static_cast<int64_t>(problems.size());
  std::vector<int64_t> tasks_at(n + 1, 0);
  for (int64_t i = 0; i < n; ++i)
    tasks_at[i + 1] = tasks_at[i] + problems[i].heads * ((problems[i].q_len + kPositions - 1) / kPositions);
  const int64_t tasks = tasks_at[n];
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(problems[0].dim);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t t = u % 2 == 0 ? u / 2 : tasks - 1 - u / 2;
      const int64_t i = std::upper_bound(tasks_at.begin(), tasks_at.end(), t) - tasks_at.begin() - 1;
      const Problem& p = problems[i];
      const int64_t blocks = (p.q_len + kPositions - 1) / kPositions, local = t - tasks_at[i];
      const int64_t i0 = (local % blocks) * kPositions;
      attend_task(p, scratch, local / blocks, i0, std::min<int64_t>(kPositions, p.q_len - i0));
    }
    at::native::cpublas::brgemm_release();
  });
}

// Keys and values as the GEMMs read them (see the top of this file), from rows at any row and
// head strides: `keys` keys of one sequence, packed `padded` slots per KV head (the slots past
// its keys are zeros).
struct Packing {
  const uint16_t *k, *v;
  int64_t k_row, k_head, v_row, v_head, keys, padded;
  uint32_t* kt;  // [kv_heads][D/2][padded]
  uint16_t* vv;  // [kv_heads][padded/2][D][2]

  Packing(const at::Tensor& key, const at::Tensor& value, int64_t first, int64_t count, int64_t slots,
          uint32_t* kt_out, uint16_t* vv_out)
      : k(reinterpret_cast<const uint16_t*>(key.data_ptr<at::BFloat16>()) + first * key.stride(0)),
        v(reinterpret_cast<const uint16_t*>(value.data_ptr<at::BFloat16>()) + first * value.stride(0)),
        k_row(key.stride(0)), k_head(key.stride(1)), v_row(value.stride(0)), v_head(value.stride(1)),
        keys(count), padded(slots), kt(kt_out), vv(vv_out) {}

  // Tasks of 16 slots of one KV head: kv_heads * padded / 16 of them.
  int64_t tasks(int64_t kv_heads) const { return kv_heads * (padded / kLanes); }

  AMX_TARGET void pack(int64_t task, int64_t D) const {
    const int64_t h = task / (padded / kLanes), n0 = (task % (padded / kLanes)) * kLanes;
    if (k_row % 2 == 0 && k_head % 2 == 0 && reinterpret_cast<uintptr_t>(k) % 4 == 0) {
      // K^T: pair d2 of the 16 keys is one gather of 32-bit words (key n0 + j's to lane j), one
      // store; V: a key pair's rows interleaved 16 dims at a time by one permute.
      const auto* first = reinterpret_cast<const int32_t*>(k + std::min(n0, keys - 1) * k_row + h * k_head);
      uint32_t* kdst = kt + h * (D / 2) * padded + n0;
      for (int64_t d2 = 0; d2 < D / 2; ++d2) {
        _mm512_storeu_si512(kdst + d2 * padded, kv_pack::gather_pairs(first, static_cast<int32_t>(k_row / 2),
                                                                      lanes(0, keys - n0), d2));
      }
      for (int64_t t0 = n0; t0 < n0 + kLanes; t0 += 2) {
        kv_pack::interleave_pair(t0 < keys ? v + t0 * v_row + h * v_head : nullptr,
                                 t0 + 1 < keys ? v + (t0 + 1) * v_row + h * v_head : nullptr,
                                 vv + h * padded * D + (t0 / 2) * D * 2, D);
      }
      return;
    }
    for (int64_t n = n0; n < n0 + kLanes; ++n) {
      const bool key = n < keys;
      pack_slot(key ? k + n * k_row + h * k_head : nullptr, key ? v + n * v_row + h * v_head : nullptr,
                kt + h * (D / 2) * padded, vv + h * padded * D, n, padded, D);
    }
  }
};

// The sequences' packings, one parallel pass over all their tasks.
void pack_all(const std::vector<Packing>& packings, int64_t kv_heads, int64_t D) {
  std::vector<int64_t> tasks_at(packings.size() + 1, 0);
  for (size_t i = 0; i < packings.size(); ++i) tasks_at[i + 1] = tasks_at[i] + packings[i].tasks(kv_heads);
  at::parallel_for(0, tasks_at.back(), 16, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t i = std::upper_bound(tasks_at.begin(), tasks_at.end(), u) - tasks_at.begin() - 1;
      packings[i].pack(u - tasks_at[i], D);
    }
  });
}

}  // namespace

at::Tensor prefill_attention_amx(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 double scale, int64_t window) {
  const int64_t q_len = q.size(0), heads = q.size(1), D = q.size(2);
  const int64_t ctx = k.size(0), kv_heads = k.size(1);
  // A block ends at its last row's position rounded up to 16 keys, never past ctx rounded so.
  const int64_t padded = (ctx + kLanes - 1) / kLanes * kLanes;
  at::Tensor kt = at::empty({kv_heads, D / 2, padded}, at::kInt);
  at::Tensor vv = at::empty({kv_heads, padded / 2, D, 2}, at::kBFloat16);
  pack_all({Packing(k, v, 0, ctx, padded, reinterpret_cast<uint32_t*>(kt.data_ptr<int32_t>()),
                   reinterpret_cast<uint16_t*>(vv.data_ptr<at::BFloat16>()))}, kv_heads, D);
  at::Tensor out = at::empty({q_len, heads, D}, q.options());
  const Run whole{0, 0, ctx};
  attend_problems({Problem{q.data_ptr<at::BFloat16>(), q.stride(0), q.stride(1), out.data_ptr<at::BFloat16>(),
                           reinterpret_cast<const at::BFloat16*>(kt.data_ptr<int32_t>()),
                           vv.data_ptr<at::BFloat16>(), q_len, ctx, heads, heads / kv_heads, D, padded,
                           static_cast<float>(scale * 1.44269504088896341), window, &whole, 1}});
  return out;
}

// Fresh prompts of one step in one call (see the header): their keys packed in one parallel
// pass, their tasks in one more; each prompt's arithmetic is that of prefill_attention_amx on
// its own rows. One call per prompt forked and joined the threads twice per prompt and split a
// prompt's few tasks unevenly over them: a step of 16 prompts of 128 tokens spent 2 ms per
// layer in it (`python bench/prefill.py --many 16x128`).
void prefill_attention_amx_into(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const int64_t* spans, int64_t n, double scale, int64_t window) {
  const int64_t heads = q.size(1), D = q.size(2), kv_heads = k.size(1);
  std::vector<int64_t> at_slot(n + 1, 0);  // where each prompt's packing starts, in bf16 elements
  for (int64_t i = 0; i < n; ++i)
    at_slot[i + 1] = at_slot[i] + kv_heads * ((spans[2 * i + 1] + kLanes - 1) / kLanes * kLanes) * D;
  at::Tensor kt = at::empty({at_slot[n] / 2}, at::kInt);
  at::Tensor vv = at::empty({at_slot[n]}, at::kBFloat16);
  auto* kp = reinterpret_cast<uint16_t*>(kt.data_ptr<int32_t>());
  auto* vp = reinterpret_cast<uint16_t*>(vv.data_ptr<at::BFloat16>());
  std::vector<Packing> packings;
  std::vector<Run> runs;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t len = spans[2 * i + 1], padded = (len + kLanes - 1) / kLanes * kLanes;
    packings.emplace_back(k, v, spans[2 * i], len, padded, reinterpret_cast<uint32_t*>(kp + at_slot[i]),
                          vp + at_slot[i]);
    runs.push_back(Run{0, 0, len});
  }
  pack_all(packings, kv_heads, D);
  std::vector<Problem> problems;
  const float scale_log2 = static_cast<float>(scale * 1.44269504088896341);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t start = spans[2 * i], len = spans[2 * i + 1];
    problems.push_back(Problem{q.data_ptr<at::BFloat16>() + start * q.stride(0), q.stride(0), q.stride(1),
                               out.data_ptr<at::BFloat16>() + start * heads * D,
                               reinterpret_cast<const at::BFloat16*>(kp + at_slot[i]),
                               reinterpret_cast<const at::BFloat16*>(vp + at_slot[i]), len, len, heads,
                               heads / kv_heads, D, packings[i].padded, scale_log2, window, &runs[i], 1});
  }
  attend_problems(problems);
}

// Prompts after a cached prefix, all of a step's in one call (see the header). Each physical
// block any of them reads is packed once, in the order first met: a prefix the prompts share
// (a system prompt, the choices of one chat) is packed once per layer, not once per prompt,
// and a prompt's keys are runs of consecutive slots (its share of the prefix, then its own
// blocks), which the GEMMs read in place.
void prefill_attention_amx_paged(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& seqs,
                                 const at::Tensor& block_tables, double scale) {
  const int64_t heads = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t n = seqs.size(0), pairs = D / 2;
  const int64_t* spans = seqs.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t table_row = block_tables.stride(0);
  // Unique blocks in the order met; per block, how many of its keys some prompt reads.
  std::unordered_map<int64_t, int64_t> index_of;
  std::vector<int64_t> blocks, filled;
  std::vector<Run> runs;
  std::vector<int64_t> runs_at(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t ctx = spans[4 * i + 2];
    const int64_t* table = tables + spans[4 * i + 3] * table_row;
    for (int64_t b = 0; b * bs < ctx; ++b) {
      const int64_t keys = std::min(bs, ctx - b * bs);
      auto [it, added] = index_of.try_emplace(table[b], static_cast<int64_t>(blocks.size()));
      if (added) {
        blocks.push_back(table[b]);
        filled.push_back(keys);
      } else {
        filled[it->second] = std::max(filled[it->second], keys);
      }
      const int64_t slot = it->second * bs;
      if (static_cast<int64_t>(runs.size()) > runs_at[i] && runs.back().slot0 + runs.back().len == slot &&
          runs.back().len == b * bs - runs.back().key0) {
        runs.back().len += keys;  // the next slots hold the next keys: one run
      } else {
        runs.push_back(Run{slot, b * bs, keys});
      }
    }
    runs_at[i + 1] = static_cast<int64_t>(runs.size());
  }
  // 16 zero slots past the last block: a block's read rounded up to 16 keys stays inside.
  const int64_t unique = static_cast<int64_t>(blocks.size()), padded = unique * bs + kLanes;
  at::Tensor kt = at::empty({kv_heads, pairs, padded}, at::kInt);
  at::Tensor vv = at::empty({kv_heads, padded / 2, D, 2}, at::kBFloat16);
  auto* kp = reinterpret_cast<uint32_t*>(kt.data_ptr<int32_t>());
  auto* vp = reinterpret_cast<uint16_t*>(vv.data_ptr<at::BFloat16>());
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  const int64_t token = kv_heads * D, block = bs * token;
  // One task per (KV head, block, or the padding): keys past a block's filled ones are zeros.
  at::parallel_for(0, kv_heads * (unique + 1), 8, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / (unique + 1), u = task % (unique + 1);
      const int64_t count = u < unique ? bs : kLanes;
      for (int64_t t = 0; t < count; ++t) {
        const bool key = u < unique && t < filled[u];
        const int64_t at = key ? blocks[u] * block + t * token + h * D : 0;
        pack_slot(key ? kc + at : nullptr, key ? vc + at : nullptr, kp + h * pairs * padded,
                  vp + h * padded * D, u * bs + t, padded, D);
      }
    }
  });
  std::vector<Problem> problems;
  const float scale_log2 = static_cast<float>(scale * 1.44269504088896341);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t start = spans[4 * i], q_len = spans[4 * i + 1], ctx = spans[4 * i + 2];
    problems.push_back(Problem{q.data_ptr<at::BFloat16>() + start * q.stride(0), q.stride(0), q.stride(1),
                               out.data_ptr<at::BFloat16>() + start * heads * D,
                               reinterpret_cast<const at::BFloat16*>(kp), vv.data_ptr<at::BFloat16>(), q_len,
                               ctx, heads, heads / kv_heads, D, padded, scale_log2, 0,
                               runs.data() + runs_at[i], runs_at[i + 1] - runs_at[i]});
  }
  attend_problems(problems);
}

}  // namespace splitserve_cpu
