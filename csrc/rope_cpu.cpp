// CPU rotary embedding + cache write, bitwise equal to HF's Llama attention between its projections and its
// attention call:
//
//     q_embed = (q * cos) + (rotate_half(q) * sin);  k_embed = (k * cos) + (rotate_half(k) * sin)
//     rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])
//
// followed by the engine's cache write of k_embed and v. Each of torch's ops there rounds once to the
// tensor's dtype (a bf16 op computes in float32 and rounds to bf16; negation is exact), so computing
// a = round(x * cos), b = round(rot * sin), round(a + b) per element, in that order and without FMA
// contraction (this file is built with -ffp-contract=off), gives the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cache_ops.h"
#include "float_bits.h"
#include "rope_ops.h"

namespace oppo {

namespace {

// x: [tokens, heads, dim] with strides (x_token, x_head, 1) (a view of a grouped q|k|v product qualifies);
// out: the same shape, contiguous.
template <typename T>
void rotate(const T* x, int64_t x_token, int64_t x_head, const T* cos, const T* sin, T* out, int64_t tokens,
            int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + t * x_token + h * x_head;
        T* o = out + (t * heads + h) * dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = widen(narrow<T>(widen(xr[i]) * widen(c[i])));
          const float b = widen(narrow<T>(-widen(xr[i + half]) * widen(s[i])));
          o[i] = narrow<T>(a + b);
        }
        for (int64_t i = half; i < dim; ++i) {
          const float a = widen(narrow<T>(widen(xr[i]) * widen(c[i])));
          const float b = widen(narrow<T>(widen(xr[i - half]) * widen(s[i])));
          o[i] = narrow<T>(a + b);
        }
      }
    }
  });
}

void check_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const char* name) {
  TORCH_CHECK_VALUE(x.dim() == 3 && (x.size(2) <= 1 || x.stride(2) == 1), "rotary_and_cache: ", name,
                    " must be a [T, H, D] whose last dim is contiguous, got ", x.sizes(), " with strides ", x.strides());
  TORCH_CHECK_VALUE(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) &&
                        cos.size(1) == x.size(2) && cos.is_contiguous() && sin.is_contiguous(),
                    "rotary_and_cache: cos and sin must be contiguous [T, D] matching ", name, " ", x.sizes(),
                    ", got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK_VALUE(x.size(2) % 2 == 0, "rotary_and_cache: head_dim must be even, got ", x.size(2));
  TORCH_CHECK_VALUE(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type() &&
                        (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                    "rotary_and_cache: ", name, ", cos and sin must all be float32 or all bfloat16");
  TORCH_CHECK_VALUE(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(),
                    "rotary_and_cache: CPU tensors only");
}

at::Tensor rotated(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  auto out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) {
    return out;
  }
  if (x.scalar_type() == at::kFloat) {
    rotate(x.const_data_ptr<float>(), x.stride(0), x.stride(1), cos.const_data_ptr<float>(),
           sin.const_data_ptr<float>(), out.mutable_data_ptr<float>(), x.size(0), x.size(1), x.size(2));
  } else {
    rotate(x.const_data_ptr<c10::BFloat16>(), x.stride(0), x.stride(1), cos.const_data_ptr<c10::BFloat16>(),
           sin.const_data_ptr<c10::BFloat16>(), out.mutable_data_ptr<c10::BFloat16>(), x.size(0), x.size(1),
           x.size(2));
  }
  return out;
}

}  // namespace

at::Tensor rotary_and_cache_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                const at::Tensor& sin, at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                                int64_t layer) {
  check_rotary(q, cos, sin, "q");
  check_rotary(k, cos, sin, "k");
  // The cache write's own checks (shapes, dtypes, slots, layer) run before anything is written.
  auto k_embed = rotated(k, cos, sin);
  reshape_and_cache_cpu(k_embed, v, kv_cache, slot_mapping, layer);
  return rotated(q, cos, sin);
}

}  // namespace oppo
