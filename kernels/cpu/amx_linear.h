// The AMX linear (amx_linear.cpp), for the kernels that call it directly (fused_decode.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace splitserve_cpu {

// Whether this CPU and kernel have AMX BF16 tiles to run amx_linear on.
bool has_amx_linear();

// weight [N, K] bfloat16 (K a multiple of 32) in the layout amx_linear reads.
at::Tensor amx_pack_linear_weight(const at::Tensor& weight);

// x [M, K] @ W^T (+ bias), W as amx_pack_linear_weight packed it, N = out_features.
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed,
                      const std::optional<at::Tensor>& bias, int64_t out_features);

}  // namespace splitserve_cpu
