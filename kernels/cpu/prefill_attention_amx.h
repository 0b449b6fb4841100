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

}  // namespace splitserve_cpu
