// Paged decode attention on CPU: one query token per sequence, K and V read once, in place,
// from the paged cache (no gather into a padded copy), float32 accumulation.
// Reference and oracle: kernels/attention.py paged_decode_attention.
//
// query [B, heads, D]; k_cache/v_cache [blocks, block_size, kv_heads, D] (contiguous);
// block_tables [B, >= cdiv(len, block_size)] int64; seq_lens [B] int64 -> [B, heads, D].
// window > 0 (a sliding-window layer): each query reads only the last `window` tokens of its
// context; those before are never touched.
// Query head h reads KV head h / (heads / kv_heads), as transformers' repeat_kv does.
// Rows behind a shared prefix (shared_prefix_of / shared_prefix_lens) attend it once for all of
// them (shared_prefix_decode.h); each row's own tokens go through per_row_decode.h.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "decode_attention_parts.h"
#include "per_row_decode.h"
#include "shared_prefix_decode.h"
#include "vector_math.h"

namespace {

using splitserve_cpu::attend_group;
using splitserve_cpu::decode_task_generic;
using splitserve_cpu::kSharedChunkTokens;
using splitserve_cpu::Partial;
using splitserve_cpu::to_float;

// Context tokens per chunk at least: below this a chunk's fixed costs outweigh the balance.
constexpr int64_t kMinChunkTokens = 64;

// Decode rows whose contexts begin with the same blocks (a system prompt, a document asked
// about): each prefix is attended once for all of its rows (shared_prefix_decode.h), each row's
// own tokens after it as usual, and the two combined as a context's chunks are.
struct SharedPrefixes {
  int64_t count = 0;
  const int64_t* of = nullptr;      // [batch]: the prefix row b's context begins with, -1: none
  const int64_t* tokens = nullptr;  // [count]: each prefix's length in tokens
};

// One task over a shared prefix: query heads of all its rows for one KV head, over tokens
// [t0, t1); its partials are `rows` maxima and sums from `at`, and rows x dim values from
// at * dim.
struct SharedTask {
  int64_t prefix, kv_head, t0, t1, rows, at;
};

template <typename scalar_t>
void decode_kernel(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                   int64_t window, const SharedPrefixes& shared, at::Tensor& out) {
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

  // Each shared prefix's rows, in batch order; a row's place among them.
  std::vector<std::vector<int64_t>> members(shared.count);
  std::vector<int64_t> place(batch, -1);
  for (int64_t b = 0; b < batch && shared.count; ++b)
    if (shared.of[b] >= 0) {
      place[b] = static_cast<int64_t>(members[shared.of[b]].size());
      members[shared.of[b]].push_back(b);
    }
  std::vector<SharedTask> shared_tasks;
  std::vector<int64_t> shared_first(shared.count + 1, 0);  // prefix p's tasks: [first[p], first[p + 1])
  int64_t shared_rows = 0;
  for (int64_t p = 0; p < shared.count; ++p) {
    const int64_t rows = static_cast<int64_t>(members[p].size()) * group, len = shared.tokens[p];
    for (int64_t kvh = 0; kv_heads && rows && kvh < kv_heads; ++kvh)
      for (int64_t t0 = 0; t0 < len; t0 += kSharedChunkTokens) {
        shared_tasks.push_back({p, kvh, t0, std::min(len, t0 + kSharedChunkTokens), rows, shared_rows});
        shared_rows += rows;
      }
    shared_first[p + 1] = static_cast<int64_t>(shared_tasks.size());
  }

  // Tasks are (sequence, KV head, chunk of the context): a KV head's query heads share every
  // K/V row read. With fewer (sequence, KV head) pairs than two per thread (batch 1: three
  // pairs on SmolLM2, so one thread did two and the other one), each context is cut into
  // chunks, attended apart and combined after, as flash-decoding does. A row behind a shared
  // prefix reads its own tokens only, from the prefix's end.
  const int64_t pairs = batch * kv_heads;
  // The first context token each sequence reads: past the window, the ones before it weigh 0.
  auto first_token = [&](int64_t b) {
    if (place[b] >= 0) return shared.tokens[shared.of[b]];
    return window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
  };
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) longest = std::max(longest, lens[b] - first_token(b));
  const int64_t threads = at::get_num_threads();
  int64_t chunks = 1;
  if (pairs < 2 * threads)  // every pair in as many chunks as two per thread: an even split
    chunks = std::max<int64_t>(1, std::min(2 * threads, longest / kMinChunkTokens));
  std::vector<float> max_buf(pairs * chunks * group), sum_buf(pairs * chunks * group),
      acc_buf(pairs * chunks * group * dim);
  std::vector<float> shared_max(shared_rows), shared_sum(shared_rows), shared_acc(shared_rows * dim);

  // Shared-prefix tasks first (the longest), then the rows' own. Without shared prefixes the
  // tasks are split in even contiguous runs, one per thread; with them a thread takes the next
  // task as it finishes one, since a prefix's task is many rows' work. (Taken one at a time,
  // neighbouring tasks went to different threads, and per-row tasks ran 20-30% slower: a
  // sequence's KV heads lie side by side in its token rows, fetched together.)
  const int64_t num_shared = static_cast<int64_t>(shared_tasks.size());
  const int64_t num_tasks = num_shared + pairs * chunks;
  std::atomic<int64_t> next_task{0};
  const int64_t workers = num_shared ? std::min(threads, num_tasks) : num_tasks;
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(std::max(group, shared_rows ? group * batch : 0) * dim), row(dim), scores;
    splitserve_cpu::SharedScratch scratch;
    std::vector<const scalar_t*> q_rows;
    auto next = [&](int64_t task) {
      if (!num_shared) return task + 1 < end ? task + 1 : num_tasks;
      return next_task++;
    };
    for (int64_t task = num_shared ? next_task++ : begin; task < num_tasks; task = next(task)) {
      if (task < num_shared) {
        const SharedTask& st = shared_tasks[task];
        Partial part{shared_max.data() + st.at, shared_sum.data() + st.at, shared_acc.data() + st.at * dim};
        const int64_t* table = tables + members[st.prefix][0] * table_width;
        q_rows.clear();
        for (const int64_t b : members[st.prefix])
          for (int64_t g = 0; g < group; ++g)
            q_rows.push_back(q_data + b * q_stride_b + (st.kv_head * group + g) * q_stride_h);
#ifdef __AVX512F__
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          if (dim == 64 && splitserve_cpu::has_avx512_bf16()) {
            splitserve_cpu::shared_prefix_task_bf16_d64(
                q_rows.data(), st.rows, k_data, v_data, table, st.t0, st.t1, block_size,
                block_stride, token_stride, st.kv_head * dim, static_cast<float>(scale), scratch, part);
            continue;
          }
        }
#endif
        for (int64_t r = 0; r < st.rows; ++r) {  // any dtype and dim: every row through floats
          to_float(q_rows[r], q.data() + r * dim, dim);
          for (int64_t d = 0; d < dim; ++d) q[r * dim + d] *= static_cast<float>(scale);
        }
        scores.resize(st.rows * (st.t1 - st.t0));
        decode_task_generic<scalar_t>(q.data(), k_data, v_data, table, st.t0, st.t1, st.rows, dim,
                                      block_size, block_stride, token_stride, st.kv_head * dim,
                                      scores.data(), row.data(), part);
        continue;
      }
      const int64_t own = task - num_shared;
      const int64_t pair = own / chunks, chunk = own % chunks;
      const int64_t b = pair / kv_heads, kvh = pair % kv_heads;
      const int64_t first = first_token(b), span = lens[b] - first;
      const int64_t t0 = first + span * chunk / chunks, t1 = first + span * (chunk + 1) / chunks;
      Partial part{max_buf.data() + own * group, sum_buf.data() + own * group,
                   acc_buf.data() + own * group * dim};
      if (t1 == t0) {  // an empty chunk of a short context: adds nothing
        std::fill(part.max, part.max + group, -std::numeric_limits<float>::infinity());
        std::fill(part.sum, part.sum + group, 0.0f);
        std::fill(part.acc, part.acc + group * dim, 0.0f);
        continue;
      }
      attend_group<scalar_t>(q_data, q_stride_b, q_stride_h, b, kvh, group, dim, scale, k_data,
                             v_data, tables + b * table_width, t0, t1, block_size, block_stride,
                             token_stride, q, row, scores, part);
    }
  });

  // Combine each query head's chunks (and its prefix's): rescale each to the largest maximum,
  // then normalize.
  at::parallel_for(0, pairs, 16, [&](int64_t begin, int64_t end) {
    std::vector<const float*> maxes, sums, accs;
    std::vector<float> weights;
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / kv_heads, kvh = pair % kv_heads;
      for (int64_t g = 0; g < group; ++g) {
        maxes.clear(), sums.clear(), accs.clear();
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t i = (pair * chunks + c) * group + g;
          maxes.push_back(&max_buf[i]), sums.push_back(&sum_buf[i]), accs.push_back(&acc_buf[i * dim]);
        }
        if (place[b] >= 0) {
          const int64_t p = shared.of[b];
          // Prefix p's tasks: kv_heads runs of the same number of chunks, KV head by KV head.
          const int64_t per_head = (shared_first[p + 1] - shared_first[p]) / kv_heads;
          for (int64_t t = shared_first[p] + kvh * per_head; t < shared_first[p] + (kvh + 1) * per_head; ++t) {
            const int64_t i = shared_tasks[t].at + place[b] * group + g;
            maxes.push_back(&shared_max[i]), sums.push_back(&shared_sum[i]), accs.push_back(&shared_acc[i * dim]);
          }
        }
        const int64_t parts = static_cast<int64_t>(maxes.size());
        weights.resize(parts);
        float max = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < parts; ++c) max = std::max(max, *maxes[c]);
        float sum = 0.0f;
        for (int64_t c = 0; c < parts; ++c) {
          weights[c] = *sums[c] == 0.0f ? 0.0f : std::exp(*maxes[c] - max);
          sum += weights[c] * *sums[c];
        }
        const float inv = 1.0f / sum;
        scalar_t* o = out_data + (b * heads + kvh * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) {
          float value = 0.0f;
          for (int64_t c = 0; c < parts; ++c) value += weights[c] * accs[c][d];
          o[d] = static_cast<scalar_t>(value * inv);
        }
      }
    }
  });
}

// shared_prefix_of / shared_prefix_lens (both or neither): see SharedPrefixes. Each prefix's
// rows must hold its blocks at the head of their block tables, and be at least as long as it;
// a sliding-window layer (window > 0) ignores them and reads each row's window on its own.
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window,
                                  const std::optional<at::Tensor>& shared_prefix_of,
                                  const std::optional<at::Tensor>& shared_prefix_lens) {
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
  TORCH_CHECK(shared_prefix_of.has_value() == shared_prefix_lens.has_value(),
              "shared_prefix_of and shared_prefix_lens come together");
  SharedPrefixes shared;
  at::Tensor of, prefix_lens;
  if (shared_prefix_of.has_value() && window == 0) {
    of = shared_prefix_of->contiguous();
    prefix_lens = shared_prefix_lens->contiguous();
    TORCH_CHECK(of.scalar_type() == at::kLong && prefix_lens.scalar_type() == at::kLong &&
                    of.dim() == 1 && prefix_lens.dim() == 1 && of.size(0) == query.size(0),
                "shared_prefix_of must be int64 [B] and shared_prefix_lens int64 [prefixes]");
    shared = {prefix_lens.size(0), of.data_ptr<int64_t>(), prefix_lens.data_ptr<int64_t>()};
    const int64_t* table_data = tables.data_ptr<int64_t>();
    std::vector<int64_t> holder(shared.count, -1);  // each prefix's first row
    for (int64_t b = 0; b < lens.numel(); ++b) {
      const int64_t p = shared.of[b];
      if (p < 0) continue;
      TORCH_CHECK(p < shared.count, "shared_prefix_of names prefix ", p, " of ", shared.count);
      const int64_t n = shared.tokens[p];
      TORCH_CHECK(n >= 1 && n <= len_data[b], "a shared prefix must be 1 token or more and no "
                  "longer than each of its rows (", n, " tokens, a row of ", len_data[b], ")");
      if (holder[p] < 0) {
        holder[p] = b;
        continue;
      }
      const int64_t* mine = table_data + b * tables.size(1);
      const int64_t* first = table_data + holder[p] * tables.size(1);
      for (int64_t i = 0; i < (n + k_cache.size(1) - 1) / k_cache.size(1); ++i)
        TORCH_CHECK(mine[i] == first[i], "rows sharing a prefix must share its blocks");
    }
  }
  at::Tensor out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "float64 is not supported");
    } else {
      decode_kernel<scalar_t>(query, k_cache, v_cache, tables, lens, scale, window, shared, out);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(splitserve_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window=0, Tensor? shared_prefix_of=None, "
        "Tensor? shared_prefix_lens=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
