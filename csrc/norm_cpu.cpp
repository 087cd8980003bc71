// CPU RMSNorm bitwise equal to HF's Llama-form RMSNorm forward (transformers' LlamaRMSNorm and its copies):
//
//     h = x.to(float32); variance = h.pow(2).mean(-1, keepdim=True)
//     h = h * torch.rsqrt(variance + eps); return weight * h.to(x.dtype)
//
// Every elementwise step of that forward rounds once, in IEEE single precision (bf16 values are widened
// exactly and narrowed round-to-nearest-even, as torch's kernels do), so one loop doing the same steps in
// the same order gives the same bits. The one step that is not elementwise, the mean, is torch's own
// (at::mean over the same [..., H] float32 squares, hence the same summation order). What the fusion saves
// is the five other ops' dispatch, allocation and passes over the rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>

#include "float_bits.h"
#include "norm_ops.h"

namespace oppo {

namespace {

// Rows per parallel chunk: the elementwise loops are cheap, so only a prefill's rows are split.
constexpr int64_t kRowGrain = 64;

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
// The row loops are built for AVX-512 and for this file's baseline (AVX2), the loader picking one for this CPU
// (ifunc): 16 lanes where the CPU has them. Each lane's arithmetic is the same single rounding, so the clones
// give the same bits.
#define OPPO_NORM_CLONES __attribute__((target_clones("arch=x86-64-v4", "default")))
#else
#define OPPO_NORM_CLONES
#endif

template <typename T>
inline __attribute__((always_inline)) void square_row(const T* xr, float* sr, int64_t hidden) {
  for (int64_t i = 0; i < hidden; ++i) {
    const float h = widen(xr[i]);
    sr[i] = h * h;  // pow(h, 2) is h * h in torch's kernel
  }
}

template <typename T>
inline __attribute__((always_inline)) void scale_row(const T* xr, const T* w, float inv, T* outr, int64_t hidden) {
  for (int64_t i = 0; i < hidden; ++i) {
    const float h = widen(xr[i]) * inv;
    // h.to(dtype), then weight * h: a bf16 product is taken in float32 and rounded once to bf16.
    outr[i] = narrow<T>(widen(w[i]) * widen(narrow<T>(h)));
  }
}

// The rows [begin, end) of each pass, one overload per dtype (target_clones takes no templates).
OPPO_NORM_CLONES void square_range(const float* x, float* sq, int64_t begin, int64_t end, int64_t hidden) {
  for (int64_t r = begin; r < end; ++r) {
    square_row(x + r * hidden, sq + r * hidden, hidden);
  }
}
OPPO_NORM_CLONES void square_range(const c10::BFloat16* x, float* sq, int64_t begin, int64_t end, int64_t hidden) {
  for (int64_t r = begin; r < end; ++r) {
    square_row(x + r * hidden, sq + r * hidden, hidden);
  }
}

// torch.rsqrt(variance + eps): the sum rounded, then 1 / sqrt(.) (torch's rsqrt, scalar and vector).
inline __attribute__((always_inline)) float inv_rms(float variance, float eps) {
  const float denom = variance + eps;
  return 1.0f / std::sqrt(denom);
}

OPPO_NORM_CLONES void scale_range(const float* x, const float* w, const float* variance, float eps, float* out,
                                  int64_t begin, int64_t end, int64_t hidden) {
  for (int64_t r = begin; r < end; ++r) {
    scale_row(x + r * hidden, w, inv_rms(variance[r], eps), out + r * hidden, hidden);
  }
}
OPPO_NORM_CLONES void scale_range(const c10::BFloat16* x, const c10::BFloat16* w, const float* variance, float eps,
                                  c10::BFloat16* out, int64_t begin, int64_t end, int64_t hidden) {
  for (int64_t r = begin; r < end; ++r) {
    scale_row(x + r * hidden, w, inv_rms(variance[r], eps), out + r * hidden, hidden);
  }
}

template <typename T>
void square_rows(const T* x, float* sq, int64_t rows, int64_t hidden) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) { square_range(x, sq, begin, end, hidden); });
}

template <typename T>
void scale_rows(const T* x, const T* w, const float* variance, float eps, T* out, int64_t rows, int64_t hidden) {
  at::parallel_for(0, rows, kRowGrain,
                   [&](int64_t begin, int64_t end) { scale_range(x, w, variance, eps, out, begin, end, hidden); });
}

}  // namespace

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0),
                    "rms_norm: x must be [..., H] and weight [H], got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK_VALUE(x.scalar_type() == weight.scalar_type() &&
                        (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                    "rms_norm: x and weight must both be float32 or both bfloat16, got ", x.scalar_type(), " and ",
                    weight.scalar_type());
  TORCH_CHECK_VALUE(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK_VALUE(x.is_contiguous() && weight.is_contiguous(), "rms_norm: x and weight must be contiguous");
  const int64_t hidden = x.size(-1);
  const int64_t rows = hidden == 0 ? 0 : x.numel() / hidden;
  auto sq = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  auto out = at::empty_like(x);
  if (x.numel() == 0) {
    return out;
  }
  if (x.scalar_type() == at::kFloat) {
    square_rows(x.data_ptr<float>(), sq.data_ptr<float>(), rows, hidden);
  } else {
    square_rows(x.data_ptr<c10::BFloat16>(), sq.data_ptr<float>(), rows, hidden);
  }
  // torch's own reduction over the squares, with HF's shape: the same kernel, the same order.
  const auto variance = at::mean(sq, {-1}, /*keepdim=*/true).contiguous();
  const float eps_f = static_cast<float>(eps);  // torch converts the Python scalar to the tensor's float
  if (x.scalar_type() == at::kFloat) {
    scale_rows(x.data_ptr<float>(), weight.data_ptr<float>(), variance.data_ptr<float>(), eps_f,
               out.data_ptr<float>(), rows, hidden);
  } else {
    scale_rows(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), variance.data_ptr<float>(), eps_f,
               out.data_ptr<c10::BFloat16>(), rows, hidden);
  }
  return out;
}

}  // namespace oppo
