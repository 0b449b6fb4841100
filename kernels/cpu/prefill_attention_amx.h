// The AMX prefill attention (prefill_attention_amx.cpp), called by prefill_attention.
#pragma once

#include <ATen/ATen.h>

namespace splitserve_cpu {

// Whether this CPU and torch's oneDNN run bf16 GEMM micro-kernels on AMX tiles.
bool has_amx_bf16();

// prefill_attention's contract, on inputs it has checked; each row's D values contiguous (rows
// and heads at any stride: the query's and K/V's slices of the qkv projection are read in place).
at::Tensor prefill_attention_amx(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 double scale, int64_t window);

// Several fresh prompts of one step, all in one call: prompt i is rows [spans[2i], spans[2i] +
// spans[2i + 1]) of q, k and v (each row's D values contiguous), causal over its own rows (the
// last `window` keys when window > 0), written to the same rows of out [tokens, heads, D]
// (contiguous); other rows of out are left as they are. Spans checked by the caller.
void prefill_attention_amx_into(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const int64_t* spans, int64_t n, double scale, int64_t window);

// Prompts whose context begins with cached blocks, all of a step's in one call, reading K/V
// from the paged cache [blocks, block_size, kv_heads, D] (block_size a multiple of 16). seqs: int64 [n, 4]
// (query start, query length, context length, row of block_tables [*, blocks] int64); query
// and out [tokens, heads, D], out contiguous; each prompt's rows of out are written, causal
// over its context (no sliding window). Its K and V of this step must be in the cache.
void prefill_attention_amx_paged(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& seqs,
                                 const at::Tensor& block_tables, double scale);

}  // namespace splitserve_cpu
