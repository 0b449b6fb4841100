// What the CPU kernels share: element-wise math written so that the compiler vectorizes it, and
// the run-time checks for the AVX-512 (BF16) instructions their vector paths need.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace splitserve_cpu {

// Whether this CPU has the feature `name` (a literal, as __builtin_cpu_supports takes it).
#if defined(__x86_64__) && defined(__GNUC__)
#define SPLITSERVE_CPU_SUPPORTS(name) (__builtin_cpu_init(), __builtin_cpu_supports(name) != 0)
#else
#define SPLITSERVE_CPU_SUPPORTS(name) false
#endif

// Whether this CPU has AVX-512 BF16 (vdpbf16ps, vcvtneps2bf16): checked once per process.
inline bool has_avx512_bf16() {
  static const bool has = SPLITSERVE_CPU_SUPPORTS("avx512bf16");
  return has;
}

// Whether this CPU has AVX-512F: checked once per process.
inline bool has_avx512f() {
  static const bool has = SPLITSERVE_CPU_SUPPORTS("avx512f");
  return has;
}

// exp(x) for x <= 0 (softmax after subtracting the maximum), written so the compiler
// vectorizes it: 2^n * 2^f with n = round(x / ln 2), |f| <= 1/2, 2^f by its Taylor series to
// degree 6 (relative error below 2e-7); underflows to 0 below -87.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float y = x * 1.44269504088896341f;
  const float n = std::nearbyint(y);
  const float f = (y - n) * 0.693147180559945309f;
  float p = 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  int32_t scale_bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &scale_bits, sizeof(float));
  return p * scale;
}

}  // namespace splitserve_cpu
