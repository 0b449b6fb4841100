// What the paged decode attention's tasks share (paged_decode_attention.cpp, and the shared-prefix
// tasks of shared_prefix_decode.h): a task's partial result and the walk through a block table.
#pragma once

#include <algorithm>
#include <cstdint>

#include "vector_math.h"

namespace splitserve_cpu {
// Internal linkage, as if written in the .cpp that includes this: the hot loops inline it.
namespace {

constexpr int kLanes = 16;  // partial sums per dot product: one AVX-512 register of floats

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

  __attribute__((always_inline)) const scalar_t* next() {
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

}  // namespace
}  // namespace splitserve_cpu
