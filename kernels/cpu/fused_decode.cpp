// The decoder layers of a Llama-family model for a step of decode rows only, bfloat16, on CPU:
// one call runs every layer, so a batch-1 step pays no Python and no dispatcher round trip per
// element-wise op. Measured with torch.profiler on SmolLM2 (30 layers), the unfused layer costs
// ~20 small ops of 2-16 us each, about 3.5 of a 13.4 ms step; the matmuls and attention
// stay the kernels they were (small_m_linear, amx_linear or torch's linear, paged_decode_attention).
//
// Every element-wise step rounds to bf16 where the module path does (engine/layers/*.py), so
// the results match it except where a float32 sum (RMS) or exp (SiLU) is taken in another
// order: a bf16 ulp at most, now and then.
// Reference and oracle: the modules of engine/models/llama.py (tests/engine/test_fused_decode.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "amx_linear.h"
#include "elementwise_avx512.h"
#include "vector_math.h"

namespace {

using bf16 = c10::BFloat16;

inline float f32(bf16 v) { return static_cast<float>(v); }

// Rows of element-wise work per thread: below this the fork costs more than the work.
constexpr int64_t kRowsPerTask = 8;

// hidden <- rms_norm(hidden + residual) * weight, residual <- hidden + residual (add_residual),
// or hidden <- rms_norm(hidden) * weight, residual <- hidden (the first layer). As RMSNorm
// does in bf16: the sum rounded to bf16, the normalisation in float32 rounded to bf16, then
// the bf16 product with the weight. Read from hidden_in / residual_in, written to hidden /
// residual: the same rows (in place, the decode layers) or others (rms_norm_step, one pass
// instead of a copy and a pass).
void add_rms_norm(const bf16* hidden_in, const bf16* residual_in, bf16* hidden, bf16* residual,
                  const bf16* weight, int64_t rows, int64_t size, float eps, bool add_residual) {
  const bool vector = splitserve_cpu::has_avx512_bf16();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> x(size);
    for (int64_t r = begin; r < end; ++r) {
      const bf16* h_in = hidden_in + r * size;
      const bf16* res_in = add_residual ? residual_in + r * size : nullptr;
      bf16* h = hidden + r * size;
      bf16* res = residual + r * size;
      if (vector) {
        splitserve_cpu::avx512::rms_norm_row(h_in, res_in, h, res, weight, size, eps, add_residual, x.data());
        continue;
      }
      for (int64_t i = 0; i < size; ++i) {
        const bf16 sum = add_residual ? bf16(f32(h_in[i]) + f32(res_in[i])) : h_in[i];
        res[i] = sum;
        x[i] = f32(sum);
      }
      constexpr int kLanes = 16;  // partial sums, so the compiler vectorizes the reduction
      float lanes[kLanes] = {0.0f};
      int64_t i = 0;
      for (; i + kLanes <= size; i += kLanes)
        for (int j = 0; j < kLanes; ++j) lanes[j] += x[i + j] * x[i + j];
      float squares = 0.0f;
      for (int j = 0; j < kLanes; ++j) squares += lanes[j];
      for (; i < size; ++i) squares += x[i] * x[i];
      const float inv_rms = 1.0f / std::sqrt(squares / static_cast<float>(size) + eps);
      for (int64_t k = 0; k < size; ++k) h[k] = bf16(f32(weight[k]) * f32(bf16(x[k] * inv_rms)));
    }
  });
}

// In place: hidden and residual are read and written.
void add_rms_norm(bf16* hidden, bf16* residual, const bf16* weight, int64_t rows, int64_t size,
                  float eps, bool add_residual) {
  add_rms_norm(hidden, residual, hidden, residual, weight, rows, size, eps, add_residual);
}

// Rotate Q and K of each row of qkv [rows, (heads + 2 kv_heads) * D] (rotate-half layout):
// x * cos + swap_halves(x) * signed_sin, each product and the sum rounded to bf16 as the
// module path does. Q goes to q [rows, heads, D]; K and V to their cache slots.
// k_out, v_out: nullptr, or [rows, kv_heads, dim] that also receive this step's K (rotated) and V
// (prefill attention reads a fresh prompt's K/V from them rather than from the paged cache).
void rotate_and_store(const bf16* qkv, int64_t qkv_stride, const bf16* cos, const bf16* sin,
                      int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, bf16* q,
                      bf16* k_cache, bf16* v_cache, const int64_t* slots,
                      bf16* k_out = nullptr, bf16* v_out = nullptr) {
  const int64_t half = dim / 2, token = kv_heads * dim;
  auto rotate = [&](const bf16* x, const bf16* c, const bf16* s, bf16* out) {
    for (int64_t i = 0; i < dim; ++i) {
      const bf16 swapped = i < half ? x[i + half] : x[i - half];
      out[i] = bf16(f32(bf16(f32(x[i]) * f32(c[i]))) + f32(bf16(f32(swapped) * f32(s[i]))));
    }
  };
  const bool vector = splitserve_cpu::has_avx512_bf16() && dim % 32 == 0;
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const bf16* row = qkv + r * qkv_stride;
      const bf16* c = cos + r * dim;
      const bf16* s = sin + r * dim;
      bf16* k_slot = k_cache + slots[r] * token;
      bf16* v_slot = v_cache + slots[r] * token;
      if (vector) {
        for (int64_t h = 0; h < heads; ++h)
          splitserve_cpu::avx512::rotate_head(row + h * dim, c, s, q + (r * heads + h) * dim, dim);
        for (int64_t h = 0; h < kv_heads; ++h)
          splitserve_cpu::avx512::rotate_head(row + (heads + h) * dim, c, s, k_slot + h * dim, dim);
      } else {
        for (int64_t h = 0; h < heads; ++h) rotate(row + h * dim, c, s, q + (r * heads + h) * dim);
        for (int64_t h = 0; h < kv_heads; ++h) rotate(row + (heads + h) * dim, c, s, k_slot + h * dim);
      }
      const bf16* v = row + (heads + kv_heads) * dim;
      std::memcpy(v_slot, v, token * sizeof(bf16));
      if (k_out != nullptr) {
        std::memcpy(k_out + r * token, k_slot, token * sizeof(bf16));
        std::memcpy(v_out + r * token, v, token * sizeof(bf16));
      }
    }
  });
}

// silu(gate) * up over gate_up [rows, 2 * size] -> out [rows, size]: SiLU in float32 rounded
// to bf16, then the bf16 product, as F.silu(gate) * up does.
void silu_and_mul(const bf16* gate_up, bf16* out, int64_t rows, int64_t size) {
  if (splitserve_cpu::has_avx512_bf16()) {
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        splitserve_cpu::avx512::silu_and_mul_row(gate_up + r * 2 * size, gate_up + r * 2 * size + size,
                                                 out + r * size, size);
    });
    return;
  }
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> act(size);
    for (int64_t r = begin; r < end; ++r) {
      const bf16* gate = gate_up + r * 2 * size;
      const bf16* up = gate + size;
      bf16* o = out + r * size;
      float* a = act.data();
      // silu(g) = g / (1 + exp(-g)) as torch computes it (so where exp(-g) overflows, g < -88.7,
      // it is -0 here too), with exp(-|g|) from exp_nonpositive, squared from half the argument
      // so that it reaches below float's normal range, and exp(|g|) as its reciprocal: no call
      // and no branch, so the loop vectorizes (std::exp in it ran 5-10x slower than torch's
      // silu at 8-2048 rows).
      for (int64_t i = 0; i < size; ++i) {
        const float g = f32(gate[i]);
        const float half = splitserve_cpu::exp_nonpositive(-0.5f * std::fabs(g));
        const float e = half * half;
        a[i] = g / (1.0f + (g >= 0.0f ? e : 1.0f / e));
      }
      for (int64_t i = 0; i < size; ++i) o[i] = bf16(f32(bf16(a[i])) * f32(up[i]));
    }
  });
}

bf16* ptr(const at::Tensor& t) { return t.data_ptr<bf16>(); }

void check_bf16_matrix(const at::Tensor& t, int64_t rows, int64_t cols, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous(), what, " must be contiguous bfloat16");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, what, " must be [", rows, ", ",
              cols, "], got ", t.sizes());
}

void check_bf16_vector(const at::Tensor& t, int64_t size, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.dim() == 1 && t.size(0) == size,
              what, " must be contiguous bfloat16 [", size, "]");
}

// hidden [rows, H] (the embeddings of this step's tokens) -> the final norm's output [rows, H].
// Per layer l: input_norm[l], qkv_weight[l] (+ qkv_bias[l] when the list is not empty),
// o_weight[l], post_norm[l], gate_up_weight[l], down_weight[l], and the caches
// k_caches[l] / v_caches[l] [blocks, block_size, kv_heads, D]. cos/sin [rows, D]: this step's
// rotary angles (signed sin, see engine/layers/rotary.py). slot_mapping, block_tables and
// seq_lens as paged_decode_attention takes them; one query token per row. windows: layer l's
// sliding window (0: none), as paged_decode_attention takes it; empty: no layer has one.
// packed: empty, or every layer's four weights packed (kernels/packed_weights.py: for the AMX
// kernel, dense, or for oneDNN, mkldnn tensors), layer by layer in the order qkv, o, gate_up,
// down: rows past small_m_max_rows read those. shared_prefix_of / shared_prefix_lens: the rows'
// shared prefixes, as paged_decode_attention takes them (None: none).
at::Tensor decode_layers(const at::Tensor& hidden_in, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList input_norm, at::TensorList qkv_weight, at::TensorList qkv_bias,
                         at::TensorList o_weight, at::TensorList post_norm,
                         at::TensorList gate_up_weight, at::TensorList down_weight,
                         const at::Tensor& final_norm, at::TensorList k_caches,
                         at::TensorList v_caches, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         int64_t heads, int64_t kv_heads, double eps, double scale,
                         int64_t small_m_max_rows, at::TensorList packed, at::IntArrayRef windows,
                         const std::optional<at::Tensor>& shared_prefix_of,
                         const std::optional<at::Tensor>& shared_prefix_lens) {
  const int64_t layers = static_cast<int64_t>(input_norm.size());
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.scalar_type() == at::kBFloat16,
              "hidden must be [rows, hidden_size] bfloat16");
  const int64_t rows = hidden_in.size(0), size = hidden_in.size(1);
  TORCH_CHECK(layers > 0, "no layers");
  for (auto list : {qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, k_caches, v_caches})
    TORCH_CHECK(static_cast<int64_t>(list.size()) == layers, "one tensor per layer in every list");
  TORCH_CHECK(qkv_bias.empty() || static_cast<int64_t>(qkv_bias.size()) == layers,
              "qkv_bias: none or one per layer");
  TORCH_CHECK(windows.empty() || static_cast<int64_t>(windows.size()) == layers,
              "windows: none or one per layer");
  for (const int64_t w : windows) TORCH_CHECK(w >= 0, "a window must be >= 0 (0: none)");
  TORCH_CHECK(packed.empty() || static_cast<int64_t>(packed.size()) == 4 * layers,
              "packed: none or four per layer");
  const int64_t dim = k_caches[0].size(3);
  TORCH_CHECK(k_caches[0].size(2) == kv_heads && heads % kv_heads == 0 && dim % 2 == 0,
              "heads, kv_heads and the caches' shape disagree");
  const int64_t qkv_size = (heads + 2 * kv_heads) * dim;
  const int64_t inter = down_weight[0].size(1);
  check_bf16_matrix(cos, rows, dim, "cos");
  check_bf16_matrix(sin, rows, dim, "sin");
  check_bf16_vector(final_norm, size, "final_norm");
  for (int64_t l = 0; l < layers; ++l) {
    check_bf16_vector(input_norm[l], size, "input_norm");
    check_bf16_vector(post_norm[l], size, "post_norm");
    check_bf16_matrix(qkv_weight[l], qkv_size, size, "qkv_weight");
    if (!qkv_bias.empty()) check_bf16_vector(qkv_bias[l], qkv_size, "qkv_bias");
    check_bf16_matrix(o_weight[l], size, heads * dim, "o_weight");
    check_bf16_matrix(gate_up_weight[l], 2 * inter, size, "gate_up_weight");
    check_bf16_matrix(down_weight[l], size, inter, "down_weight");
    TORCH_CHECK(k_caches[l].sizes() == k_caches[0].sizes() && v_caches[l].sizes() == k_caches[0].sizes() &&
                    k_caches[l].is_contiguous() && v_caches[l].is_contiguous() &&
                    k_caches[l].scalar_type() == at::kBFloat16 && v_caches[l].scalar_type() == at::kBFloat16,
                "every layer's caches must be contiguous bfloat16 of one shape");
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == rows, "slot_mapping must be int64 [rows]");
  const int64_t num_slots = k_caches[0].size(0) * k_caches[0].size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(slots[r] >= 0 && slots[r] < num_slots, "slot ", slots[r], " is outside the cache");

  static const auto attention = c10::Dispatcher::singleton()
      .findSchemaOrThrow("splitserve_cpu::paged_decode_attention", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, double, int64_t, const std::optional<at::Tensor>&,
                        const std::optional<at::Tensor>&)>();
  static const auto small_m_linear = c10::Dispatcher::singleton()
      .findSchemaOrThrow("splitserve_cpu::small_m_linear", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, bool)>();
  static const auto packed_linear = c10::Dispatcher::singleton()
      .findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const bool small = rows <= small_m_max_rows;
  // Weight `which` (0 qkv, 1 o, 2 gate_up, 3 down) of layer l.
  auto linear = [&](const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                    int64_t l, int which) {
    if (small) return small_m_linear.call(x, w, b, false);
    if (packed.empty()) return at::linear(x, w, b);
    if (!packed[4 * l + which].is_mkldnn()) return splitserve_cpu::amx_linear(x, packed[4 * l + which], b, w.size(0));
    torch::jit::Stack stack{x, packed[4 * l + which], b, std::string("none"),
                            c10::List<std::optional<at::Scalar>>(), std::optional<std::string>("")};
    packed_linear.callBoxed(&stack);
    return stack[0].toTensor();
  };

  at::Tensor hidden = hidden_in.contiguous().clone();
  at::Tensor residual = at::empty_like(hidden);
  at::Tensor q = at::empty({rows, heads, dim}, hidden.options());
  at::Tensor act = at::empty({rows, inter}, hidden.options());
  const at::Tensor cos_c = cos.contiguous(), sin_c = sin.contiguous();
  const float eps_f = static_cast<float>(eps);
  for (int64_t l = 0; l < layers; ++l) {
    add_rms_norm(ptr(hidden), ptr(residual), ptr(input_norm[l]), rows, size, eps_f, l > 0);
    const std::optional<at::Tensor> bias =
        qkv_bias.empty() ? std::nullopt : std::optional<at::Tensor>(qkv_bias[l]);
    const at::Tensor qkv = linear(hidden, qkv_weight[l], bias, l, 0);
    rotate_and_store(ptr(qkv), qkv.stride(0), ptr(cos_c), ptr(sin_c), rows, heads, kv_heads, dim,
                     ptr(q), ptr(k_caches[l]), ptr(v_caches[l]), slots);
    const at::Tensor attn = attention.call(q, k_caches[l], v_caches[l], block_tables, seq_lens, scale,
                                            windows.empty() ? 0 : windows[l], shared_prefix_of,
                                            shared_prefix_lens);
    hidden = linear(attn.view({rows, heads * dim}), o_weight[l], std::nullopt, l, 1);
    add_rms_norm(ptr(hidden), ptr(residual), ptr(post_norm[l]), rows, size, eps_f, true);
    const at::Tensor gate_up = linear(hidden, gate_up_weight[l], std::nullopt, l, 2);
    silu_and_mul(ptr(gate_up), ptr(act), rows, inter);
    hidden = linear(act, down_weight[l], std::nullopt, l, 3);
  }
  add_rms_norm(ptr(hidden), ptr(residual), ptr(final_norm), rows, size, eps_f, true);
  return hidden;
}

// The element-wise steps on their own, for tests against the module path.

std::tuple<at::Tensor, at::Tensor> rms_norm_step(const at::Tensor& hidden, const std::optional<at::Tensor>& residual,
                                                 const at::Tensor& weight, double eps) {
  TORCH_CHECK(hidden.dim() == 2, "hidden must be [rows, size]");
  check_bf16_matrix(hidden, hidden.size(0), hidden.size(1), "hidden");
  check_bf16_vector(weight, hidden.size(1), "weight");
  if (residual.has_value()) check_bf16_matrix(*residual, hidden.size(0), hidden.size(1), "residual");
  at::Tensor out = at::empty_like(hidden);
  at::Tensor res = at::empty_like(hidden);
  add_rms_norm(ptr(hidden), residual.has_value() ? ptr(*residual) : nullptr, ptr(out), ptr(res), ptr(weight),
               hidden.size(0), hidden.size(1), static_cast<float>(eps), residual.has_value());
  return {out, res};
}

// The rotary ops' inputs: shapes, dtypes, layouts, and every slot inside the cache.
void check_rotate_inputs(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& slot_mapping, int64_t heads) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              "caches must be contiguous bfloat16 [blocks, block_size, kv_heads, D]");
  const int64_t rows = qkv.size(0), kv_heads = k_cache.size(2), dim = k_cache.size(3);
  check_bf16_matrix(qkv, rows, (heads + 2 * kv_heads) * dim, "qkv");
  check_bf16_matrix(cos, rows, dim, "cos");
  check_bf16_matrix(sin, rows, dim, "sin");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == rows, "slot_mapping must be int64 [rows]");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(slots[r] >= 0 && slots[r] < num_slots, "slot ", slots[r], " is outside the cache");
}

at::Tensor rotate_and_store_step(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                 const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& slot_mapping, int64_t heads) {
  check_rotate_inputs(qkv, cos, sin, k_cache, v_cache, slot_mapping, heads);
  const int64_t rows = qkv.size(0), kv_heads = k_cache.size(2), dim = k_cache.size(3);
  at::Tensor q = at::empty({rows, heads, dim}, qkv.options());
  rotate_and_store(ptr(qkv), qkv.stride(0), ptr(cos), ptr(sin), rows, heads, kv_heads, dim, ptr(q),
                   ptr(k_cache), ptr(v_cache), slot_mapping.data_ptr<int64_t>());
  return q;
}

// A prompt step's rotary embedding and cache write in one pass: returns (q, k, v), K rotated,
// each contiguous [rows, heads or kv_heads, dim], with K and V also stored at their slots.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rotate_and_store_split(
    const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t heads) {
  check_rotate_inputs(qkv, cos, sin, k_cache, v_cache, slot_mapping, heads);
  const int64_t rows = qkv.size(0), kv_heads = k_cache.size(2), dim = k_cache.size(3);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  at::Tensor q = at::empty({rows, heads, dim}, qkv.options());
  at::Tensor k = at::empty({rows, kv_heads, dim}, qkv.options());
  at::Tensor v = at::empty({rows, kv_heads, dim}, qkv.options());
  rotate_and_store(ptr(qkv), qkv.stride(0), ptr(cos), ptr(sin), rows, heads, kv_heads, dim, ptr(q),
                   ptr(k_cache), ptr(v_cache), slots, ptr(k), ptr(v));
  return {q, k, v};
}

at::Tensor silu_and_mul_step(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [rows, 2 * size]");
  check_bf16_matrix(gate_up, gate_up.size(0), gate_up.size(1), "gate_up");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  silu_and_mul(ptr(gate_up), ptr(out), gate_up.size(0), gate_up.size(1) / 2);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def("rms_norm_step(Tensor hidden, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotate_and_store_step(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, int heads) -> Tensor");
  m.def("rotate_and_store_split(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, int heads) -> (Tensor, Tensor, Tensor)");
  m.def("silu_and_mul_step(Tensor gate_up) -> Tensor");
  m.def("decode_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor[] input_norm, "
        "Tensor[] qkv_weight, Tensor[] qkv_bias, Tensor[] o_weight, Tensor[] post_norm, "
        "Tensor[] gate_up_weight, Tensor[] down_weight, Tensor final_norm, Tensor[] k_caches, "
        "Tensor[] v_caches, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int heads, "
        "int kv_heads, float eps, float scale, int small_m_max_rows, Tensor[] packed, "
        "int[] windows=[], Tensor? shared_prefix_of=None, Tensor? shared_prefix_lens=None) -> Tensor");
}

// Weights packed for oneDNN are MkldnnCPU tensors, which send the call to that key.
TORCH_LIBRARY_IMPL(splitserve_cpu, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }

TORCH_LIBRARY_IMPL(splitserve_cpu, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("rms_norm_step", &rms_norm_step);
  m.impl("rotate_and_store_step", &rotate_and_store_step);
  m.impl("rotate_and_store_split", &rotate_and_store_split);
  m.impl("silu_and_mul_step", &silu_and_mul_step);
}
