// CPU linear of a few bf16 rows (a decode batch of 1 to a few sequences), bitwise oneDNN's product.
//
// oneDNN (torch's mkldnn linear over a packed weight) multiplies bf16 rows with vdpbf16ps: per output, the
// inputs' pairs (2i, 2i+1) in order into a float32 sum, one sum per run of K (512 or 1024 inputs, by shape and
// rows: measured, see ops.small_linear_kblock), the runs' sums added in order, the total rounded to bf16
// (round to nearest even). Below a few rows its kernels stream the weights at about half the bandwidth; this
// one reads each 16-column panel of the weight once, contiguous, for all the rows (up to 8 at a time from
// cache), and does the same arithmetic in the same order: the caller uses it only where a probe against
// oneDNN's product found every bit equal (ops.small_linear_kblock), and oneDNN's own product elsewhere.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "linear_ops.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#include <immintrin.h>
#define OPPO_LINEAR_AVX512 1
#define OPPO_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#endif

namespace oppo {

namespace {

#ifdef OPPO_LINEAR_AVX512
// R rows of x ([R, K] as K/2 pairs each, row stride P pairs) against one 16-column panel w ([K/2] pairs x 16
// columns); out: the R rows' 16 outputs, row stride ldo.
template <int R>
OPPO_BF16 void panel_rows(const uint32_t* x, int64_t P, const __m512bh* w, int64_t run, uint16_t* out,
                          int64_t ldo) {
  if (run >= P) {  // one run: its sum is the total
    __m512 sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < P; ++p) {
      const __m512bh wp = (__m512bh)_mm512_loadu_si512(w + p);  // any 2-byte aligned tensor
      for (int r = 0; r < R; ++r) sum[r] = _mm512_dpbf16_ps(sum[r], (__m512bh)_mm512_set1_epi32(x[r * P + p]), wp);
    }
    for (int r = 0; r < R; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo), (__m256i)_mm512_cvtneps_pbh(sum[r]));
    return;
  }
  alignas(64) float total[R][16];
  for (int64_t p0 = 0; p0 < P; p0 += run) {
    __m512 sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_ps();
    const int64_t p1 = std::min(P, p0 + run);
    for (int64_t p = p0; p < p1; ++p) {
      const __m512bh wp = (__m512bh)_mm512_loadu_si512(w + p);  // any 2-byte aligned tensor
      for (int r = 0; r < R; ++r) sum[r] = _mm512_dpbf16_ps(sum[r], (__m512bh)_mm512_set1_epi32(x[r * P + p]), wp);
    }
    for (int r = 0; r < R; ++r)
      _mm512_store_ps(total[r], p0 == 0 ? sum[r] : _mm512_add_ps(_mm512_load_ps(total[r]), sum[r]));
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(total[r])));
}

OPPO_BF16 void panels(const uint32_t* x, int64_t M, int64_t P, const __m512bh* w, int64_t run, uint16_t* out,
                      int64_t N, int64_t begin, int64_t end) {
  for (int64_t b = begin; b < end; ++b) {
    const __m512bh* wb = w + b * P;
    int64_t m = 0;
    for (; m + 8 <= M; m += 8) panel_rows<8>(x + m * P, P, wb, run, out + m * N + b * 16, N);
    // The last 1-7 rows in one pass over the panel (a pass per row or per few would read it again).
    const uint32_t* xm = x + m * P;
    uint16_t* om = out + m * N + b * 16;
    switch (M - m) {
      case 7: panel_rows<7>(xm, P, wb, run, om, N); break;
      case 6: panel_rows<6>(xm, P, wb, run, om, N); break;
      case 5: panel_rows<5>(xm, P, wb, run, om, N); break;
      case 4: panel_rows<4>(xm, P, wb, run, om, N); break;
      case 3: panel_rows<3>(xm, P, wb, run, om, N); break;
      case 2: panel_rows<2>(xm, P, wb, run, om, N); break;
      case 1: panel_rows<1>(xm, P, wb, run, om, N); break;
      default: break;
    }
  }
}
#endif

}  // namespace

bool small_linear_available() {
#ifdef OPPO_LINEAR_AVX512
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

at::Tensor small_linear_cpu(const at::Tensor& x, const at::Tensor& blocked, int64_t kblock) {
  TORCH_CHECK_VALUE(small_linear_available(), "small_linear: needs an x86-64 CPU with AVX-512 BF16");
  TORCH_CHECK_VALUE(x.device().is_cpu() && blocked.device().is_cpu(), "small_linear: CPU tensors only");
  TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16 && blocked.scalar_type() == at::kBFloat16,
                    "small_linear: x and the blocked weight must be bfloat16");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.is_contiguous(), "small_linear: x must be a contiguous [M, K] tensor");
  TORCH_CHECK_VALUE(blocked.dim() == 4 && blocked.size(2) == 16 && blocked.size(3) == 2 && blocked.is_contiguous(),
                    "small_linear: the weight must be blocked as [N / 16, K / 2, 16, 2], contiguous "
                    "(ops.block_linear_weight)");
  const int64_t M = x.size(0), K = x.size(1), P = blocked.size(1), N = blocked.size(0) * 16;
  TORCH_CHECK_VALUE(K == 2 * P, "small_linear: x has ", K, " inputs, the weight ", 2 * P);
  TORCH_CHECK_VALUE(kblock > 0 && kblock % 2 == 0, "small_linear: kblock must be a positive even number");
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
#ifdef OPPO_LINEAR_AVX512
  const auto* xp = static_cast<const uint32_t*>(x.const_data_ptr());
  const auto* wp = static_cast<const __m512bh*>(blocked.const_data_ptr());
  auto* op = static_cast<uint16_t*>(out.mutable_data_ptr());
  const int64_t run = kblock / 2;
  // Panels split evenly over the threads; one panel is K * 32 bytes of weight (18 KB at K = 576).
  at::parallel_for(0, N / 16, 1, [&](int64_t b, int64_t e) { panels(xp, M, P, wp, run, op, N, b, e); });
#endif
  return out;
}

}  // namespace oppo
